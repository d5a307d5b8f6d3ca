"""workers.batching.completion.ResultWriter against a real Redis of its own (so the server's command
counts are this test's alone): a batch's results in one round trip, the first one winning,
still stored after the server lost its scripts, and a write whose reply was lost recognised
as its own when retried."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from shared import schema
from shared.celery_app import make_app
from shared.errors import BrokerUnavailable, DeadlineExceeded
from tests.conftest import own_redis as own_redis_stack
from tests.netfaults import ReplyDropper
from workers.batching.completion import _WRITE_FIRST, Outcome, ResultWriter, new_token

WRITE_SHA = hashlib.sha1(_WRITE_FIRST.encode()).hexdigest()  # the final write's script

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with own_redis_stack(tmp_path_factory, "results-run") as st:
        yield st


def _calls(admin: redis.Redis) -> dict[str, int]:
    stats = admin.info("commandstats")
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}


def _stored(admin: redis.Redis, app: Any, task_id: str) -> dict[str, Any]:
    raw = admin.get(app.backend.get_key_for_task(task_id))
    assert raw is not None, f"no result stored for {task_id}"
    return schema.loads(raw)


def test_a_batch_is_written_with_evalsha_alone_and_the_first_result_wins(own_redis: Any) -> None:
    """No ``SCRIPT EXISTS`` before the write (redis-py's Script objects in a pipeline ask it
    every time: a round trip more per batch); a second, different outcome for the same
    request is refused and the first stands."""
    app = make_app(own_redis.s, name="test-results", role="worker")
    admin = redis.Redis.from_url(own_redis.s.redis_url("admin"))
    writer = ResultWriter(app)
    ids = [f"results-{i}" for i in range(3)]
    writer.write([Outcome(ids[0], result={"warm": 1})])  # the script is loaded by now
    admin.config_resetstat()

    written = writer.write([Outcome(i, result={"n": n}) for n, i in enumerate(ids[1:])])
    again = writer.write([Outcome(ids[1], error=DeadlineExceeded("late copy"))])

    calls = _calls(admin)
    assert written == [True, True]
    assert again == [False]
    assert calls.get("evalsha") == 2  # one script call per write, whatever its size
    assert not {"script", "script|exists", "script|load"} & set(calls), calls
    assert _stored(admin, app, ids[1])["status"] == "SUCCESS"
    assert _stored(admin, app, ids[1])["result"] == {"n": 0}
    assert writer.duplicates == 1


def test_results_are_stored_after_the_server_flushed_its_scripts(own_redis: Any) -> None:
    """A restarted (or failed-over) Redis has no scripts: the write loads it and is
    repeated, and every result is stored once."""
    app = make_app(own_redis.s, name="test-results", role="worker")
    admin = redis.Redis.from_url(own_redis.s.redis_url("admin"))
    writer = ResultWriter(app)
    writer.write([Outcome("flush-warm", result={"warm": 1})])
    admin.script_flush()
    admin.config_resetstat()

    ids = [f"flush-{i}" for i in range(4)]
    written = writer.write([Outcome(i, result={"i": i}) for i in ids])

    assert written == [True] * 4
    assert [_stored(admin, app, i)["result"] for i in ids] == [{"i": i} for i in ids]
    calls = _calls(admin)
    assert calls.get("script|load", calls.get("script")) == 1, calls
    assert calls.get("evalsha") == 2  # the batch's call refused with NOSCRIPT, then run


def test_a_write_whose_reply_was_lost_is_reported_stored_when_retried(own_redis: Any) -> None:
    """The same outcomes written again with their tokens after the reply to the first write
    was lost: stored (this writer's own write), not refused as another copy's; the document
    is the first write's; another token is still refused."""
    proxy = ReplyDropper(own_redis.s.redis.port, WRITE_SHA)
    try:
        s = own_redis.s
        via_proxy = s.model_copy(update={"redis": s.redis.model_copy(update={"port": proxy.port})})
        app = make_app(via_proxy, name="test-results-lost", role="worker")
        admin = redis.Redis.from_url(s.redis_url("admin"))
        writer = ResultWriter(app)
        writer.write([Outcome("lost-warm", result={"warm": 1})])  # connected, script loaded
        ids = [f"lost-{i}" for i in range(3)]
        outcomes = [Outcome(i, result={"i": i}) for i in ids]
        tokens = [new_token() for _ in ids]

        proxy.armed = True
        with pytest.raises(redis.ConnectionError):
            writer.write(outcomes, tokens=tokens)
        assert proxy.dropped == 1
        assert [_stored(admin, app, i)["result"] for i in ids] == [{"i": i} for i in ids]

        assert writer.write(outcomes, tokens=tokens) == [True] * 3
        assert writer.duplicates == 0
        late = [Outcome(i, error=DeadlineExceeded("another copy")) for i in ids]
        assert writer.write(late, tokens=[new_token() for _ in ids]) == [False] * 3
        assert [_stored(admin, app, i)["status"] for i in ids] == ["SUCCESS"] * 3
    finally:
        proxy.close()


def test_a_write_refused_halfway_leaves_no_marker_and_its_retry_stores_the_result(
    own_redis: Any,
) -> None:
    """The worker's ACL user loses ``SETEX`` (the result document's write) while a batch is
    stored: the script is refused after its first read, and Redis keeps what a script wrote
    before a refused command. No marker may stand without its document (each request would
    read PENDING for a day while its retry, finding its own token, reported it stored); once
    ``SETEX`` is allowed again the same write with the same tokens stores every document,
    and another copy's write is then refused."""
    s = own_redis.s
    app = make_app(s, name="test-results-halfway", role="worker")
    admin = redis.Redis.from_url(s.redis_url("admin"))
    user = s.redis_credentials("worker")[0] or "default"
    writer = ResultWriter(app)
    writer.write([Outcome("halfway-warm", result={"warm": 1})])  # connected, script loaded
    ids = [f"halfway-{i}" for i in range(4)]
    outcomes = [Outcome(i, result={"i": i}) for i in ids]
    tokens = [new_token() for _ in ids]

    admin.execute_command("ACL", "SETUSER", user, "-setex")
    try:
        with pytest.raises(redis.ResponseError):
            writer.write(outcomes, tokens=tokens)
        assert [admin.exists(schema.final_key(i)) for i in ids] == [0] * 4
        assert [admin.exists(app.backend.get_key_for_task(i)) for i in ids] == [0] * 4
    finally:
        admin.execute_command("ACL", "SETUSER", user, "+setex")

    assert writer.write(outcomes, tokens=tokens) == [True] * 4
    assert [_stored(admin, app, i)["result"] for i in ids] == [{"i": i} for i in ids]
    assert [admin.get(schema.final_key(i)).decode() for i in ids] == tokens
    late = [Outcome(i, error=DeadlineExceeded("another copy")) for i in ids]
    assert writer.write(late, tokens=[new_token() for _ in ids]) == [False] * 4
    assert [_stored(admin, app, i)["status"] for i in ids] == ["SUCCESS"] * 4


def test_a_cancel_refused_halfway_leaves_no_marker_and_a_worker_result_then_wins(
    own_redis: Any,
) -> None:
    """``FleetClient.cancel`` as the producer's ACL user, which loses ``SETEX`` (the REVOKED
    document's write): the cancel raises and leaves nothing, no marker that would make
    workers drop the request's result while it reads PENDING. A worker's result then wins;
    a cancel after it returns False; a cancel of a fresh request stores REVOKED and its
    marker."""
    from producer.client import FleetClient

    s = own_redis.s
    admin = redis.Redis.from_url(s.redis_url("admin"))
    user = s.redis_credentials("producer")[0] or "default"
    client = FleetClient(s)
    app = make_app(s, name="test-results-cancel", role="worker")
    try:
        admin.execute_command("ACL", "SETUSER", user, "-setex")
        try:
            with pytest.raises(BrokerUnavailable) as refused:
                client.cancel("cancel-halfway")
            assert refused.value.reason == "NOPERM"
            assert admin.exists(schema.final_key("cancel-halfway")) == 0
        finally:
            admin.execute_command("ACL", "SETUSER", user, "+setex")

        assert ResultWriter(app).write([Outcome("cancel-halfway", result={"ran": 1})]) == [True]
        assert client.cancel("cancel-halfway") is False
        assert _stored(admin, app, "cancel-halfway")["result"] == {"ran": 1}

        assert client.cancel("cancel-fresh") is True
        assert _stored(admin, app, "cancel-fresh")["status"] == "REVOKED"
        assert admin.get(schema.final_key("cancel-fresh")) == b"1"
        assert ResultWriter(app).write([Outcome("cancel-fresh", result={"late": 1})]) == [False]
    finally:
        client.close()


def test_reading_a_stored_outcome_reads_the_result_document_once(own_redis: Any) -> None:
    """``ResultHandle.outcome()`` of a request whose result is stored: the document is read
    once (the result consumer's read when it subscribes); the outcome comes from what that
    read gave, success and coded failure alike (a second ``GET`` of the same document cost
    Redis a command per request)."""
    from producer.client import FleetClient
    from producer.client.results import ResultHandle

    app = make_app(own_redis.s, name="test-results", role="worker")
    admin = redis.Redis.from_url(own_redis.s.redis_url("admin"))
    writer = ResultWriter(app)
    ok, failed = "outcome-read-ok", "outcome-read-failed"
    writer.write([Outcome(ok, result={"n": 7}), Outcome(failed, error=DeadlineExceeded("late"))])
    client = FleetClient(own_redis.s)
    try:
        env = client.envelope("text", {"text": "x"})
        ResultHandle(client, "outcome-read-warm", env)  # the client's connections, made now
        client.live_workers("text")
        got = {}
        for task_id in (ok, failed):
            admin.config_resetstat()
            got[task_id] = ResultHandle(client, task_id, env).outcome(10)
            calls = _calls(admin)
            assert calls.get("get", 0) + calls.get("mget", 0) == 1, (task_id, calls)
    finally:
        client.close()
    assert got[ok] == {"result": {"n": 7}}
    assert got[failed]["error"]["code"] == "DEADLINE_EXCEEDED"


class _Acks:
    """The acks of a settled group (``workers.consumer.lease.AckPlan``'s Redis side)."""

    def __init__(self, tags: list[str], also: list[tuple[Any, ...]]) -> None:
        self.tags, self.also = tags, also

    def finish(self, release: bool = True) -> int:
        return len(self.tags)


def test_acks_and_their_release_go_in_the_write_call_after_the_writes(own_redis: Any) -> None:
    """A settled group costs one round trip: the results, then kombu's ZREM + HDEL of the
    messages and a tenant's ``SREM``, in the write's EVALSHA. A write refused halfway (the
    worker's user loses ``SET``, the marker's write, after the documents) acks nothing: the
    messages stay leased until a retry stores the results, which acks them then."""
    s = own_redis.s
    app = make_app(s, name="test-results-acks", role="worker")
    admin = redis.Redis.from_url(s.redis_url("admin"))
    user = s.redis_credentials("worker")[0] or "default"
    writer = ResultWriter(app)
    writer.write([Outcome("acks-warm", result={"warm": 1})])  # connected, script loaded
    ids = [f"acks-{i}" for i in range(3)]
    tags = [f"tag-{i}" for i in ids]
    open_set = "test-results-acks:open"
    admin.hset(schema.UNACKED_KEY, mapping={t: "{}" for t in tags})
    admin.zadd(schema.UNACKED_INDEX_KEY, dict.fromkeys(tags, 1.0))
    admin.sadd(open_set, *ids, "acks-other")
    outcomes = [Outcome(i, result={"i": i}) for i in ids]
    tokens = [new_token() for _ in ids]
    acks = _Acks(tags, [("SREM", open_set, *ids)])

    admin.execute_command("ACL", "SETUSER", user, "-set")
    try:
        with pytest.raises(redis.ResponseError):
            writer.write(outcomes, tokens=tokens, acks=acks)
    finally:
        admin.execute_command("ACL", "SETUSER", user, "+set")
    assert admin.zscore(schema.UNACKED_INDEX_KEY, tags[0]) == 1.0
    assert admin.hlen(schema.UNACKED_KEY) >= 3 and admin.scard(open_set) == 4

    admin.config_resetstat()
    assert writer.write(outcomes, tokens=tokens, acks=acks) == [True] * 3
    calls = _calls(admin)
    assert calls["evalsha"] == 1 and calls["zrem"] == 1 and calls["hdel"] == 1
    assert calls["srem"] == 1
    assert [_stored(admin, app, i)["result"] for i in ids] == [{"i": i} for i in ids]
    assert [admin.zscore(schema.UNACKED_INDEX_KEY, t) for t in tags] == [None] * 3
    assert [admin.hexists(schema.UNACKED_KEY, t) for t in tags] == [False] * 3
    assert admin.smembers(open_set) == {b"acks-other"}
