"""``FleetClient.submit_many``'s pipelined chunks under faults, on a Redis and text worker of
their own: a chunk pushed twice (an ``EXEC`` whose reply was lost, then retried), the
producer's connections killed between and during chunks, a Redis restart between chunks.
Every request must end with exactly one final result, run once (the worker's one log line
per finished request, ``request id=<id> state=<STATE>``).
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from producer.client import FleetClient, ResultHandle, SubmitRequest
from producer.client.fleet import CHUNK
from shared import schema
from shared.errors import BrokerUnavailable
from tests.conftest import REPO, own_text_stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    overrides = {
        "FLEET_CONFIG": str(REPO / "configs" / "fleet.toml"),
        "FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE": "16",
        "FLEET_MODALITIES__TEXT__BATCHING__LENGTH_BUCKETS": "[16]",
        "FLEET_METRICS__PORT_BASE": "0",
    }
    with own_text_stack(tmp_path_factory, "pipeline-run", overrides) as st:
        yield st


@pytest.fixture(scope="module")
def pclient(pstack: Any) -> Iterator[FleetClient]:
    c = FleetClient(pstack.s)
    yield c
    c.close()


def admin_of(st: Any) -> redis.Redis:
    return redis.Redis.from_url(st.s.redis_url("admin"), socket_timeout=5)


def words(i: int) -> str:
    return f"Sentence number {i} about a quiet river."


def runs(st: Any, task_id: str, state: str = r"\w+") -> int:
    """How many times the worker finished ``task_id`` with ``state`` (its log lines)."""
    text = (st.logs / "worker-text.log").read_text(errors="replace")
    return len(re.findall(rf"request id={re.escape(task_id)} state={state}\b", text))


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def queued(st: Any) -> int:
    """Messages waiting in the text queues."""
    r = admin_of(st)
    return sum(
        r.llen(schema.priority_list_key(q, p))
        for q in (schema.queue_name("text"), schema.realtime_queue_name("text"))
        for p in schema.PRIORITY_STEPS
    )


def taken(st: Any, task_ids: list[str]) -> int:
    """At least how many of ``task_ids`` Redis has (queued, fetched or done: the test's
    stack settles between tests, so what is queued or fetched is theirs)."""
    r = admin_of(st)
    done = r.exists(*(schema.result_key(t) for t in task_ids))
    return queued(st) + int(r.hlen(schema.UNACKED_KEY)) + int(done)


def settled(st: Any) -> bool:
    """Nothing left in the text queues or in kombu's unacked hash."""
    return queued(st) == 0 and admin_of(st).hlen(schema.UNACKED_KEY) == 0


def kill_producer_connections(st: Any) -> int:
    """``CLIENT KILL`` of every connection of the producer ACL user; how many."""
    return int(admin_of(st).client_kill_filter(user="producer"))


def assert_each_ran_once(client: FleetClient, st: Any, handles: list[ResultHandle]) -> None:
    """Every request has its final result (a success), and the worker ran each once."""
    outs = client.wait_all(handles, timeout_s=120)
    assert all(o is not None and "result" in o for o in outs), [
        o for o in outs if not o or "result" not in o
    ][:3]
    wait_for(lambda: settled(st), "the queue and unacked hash to empty")
    # The worker logs a request's line just after its ack: wait for the lines, then count.
    wait_for(lambda: all(runs(st, h.id) for h in handles), "every request's log line")
    ran = [runs(st, h.id, "SUCCESS") for h in handles]
    assert ran == [1] * len(handles), [h.id for h, n in zip(handles, ran, strict=True) if n != 1]
    assert sum(runs(st, h.id, "FAILURE") for h in handles) == 0


def prepared(client: FleetClient, n: int, start: int) -> tuple[list[ResultHandle], list[Any]]:
    """``n`` requests' handles and their messages (``FleetClient.outgoing``), not sent."""
    envs = [client.envelope("text", {"text": words(start + i)}, "bulk") for i in range(n)]
    ids = [str(uuid.uuid4()) for _ in envs]
    handles = [ResultHandle(client, i, e) for i, e in zip(ids, envs, strict=True)]
    return handles, list(client.outgoing(envs, ids))


def test_a_chunk_pushed_twice_gives_one_result_per_task_id(
    pclient: FleetClient, pstack: Any
) -> None:
    """What a retry after a lost ``EXEC`` reply does: the same chunk, byte for byte, twice."""
    handles, messages = prepared(pclient, 40, 0)
    assert list(pclient.publish_many(messages)) == [40]
    assert list(pclient.publish_many(messages)) == [40]
    assert_each_ran_once(pclient, pstack, handles)  # and both copies were acked (settled)


def test_killed_producer_connections_between_chunks_are_reconnected(
    pclient: FleetClient, pstack: Any
) -> None:
    handles, messages = prepared(pclient, 90, 100)
    sent = pclient.publish_many(messages, chunk=30)
    assert next(sent) == 30
    assert kill_producer_connections(pstack) >= 1  # the connection the next chunk uses
    assert list(sent) == [60, 90]
    assert_each_ran_once(pclient, pstack, handles)


def test_a_redis_restart_between_chunks_loses_nothing(pclient: FleetClient, pstack: Any) -> None:
    """Redis is down when the next chunk goes: it is retried (the app's publish retry policy,
    here long enough for the restart) until Redis is back."""
    client = FleetClient(pstack.s)
    client.app.conf.task_publish_retry_policy = {
        "max_retries": 50,
        "interval_start": 0,
        "interval_step": 0.1,
        "interval_max": 0.2,
    }
    handles, messages = prepared(client, 90, 200)
    sent = client.publish_many(messages, chunk=30)
    try:
        assert next(sent) == 30
        pstack.stop("redis")  # SIGTERM: Redis writes its AOF before it exits
        later = threading.Timer(1.0, pstack.start_redis)
        later.start()
        t0 = time.monotonic()
        assert list(sent) == [60, 90]
        assert time.monotonic() - t0 > 0.5  # it waited for Redis
        later.join()
        assert_each_ran_once(pclient, pstack, handles)
    finally:
        client.close()


def test_retries_exhausted_raise_with_the_handles_of_the_chunks_sent(
    pclient: FleetClient, pstack: Any
) -> None:
    """Redis gone for good after the first chunk: BROKER_UNAVAILABLE (``UNREACHABLE``) comes
    out after the publish retries, carrying the handles of the chunk sent; those requests
    complete, the others never ran."""

    class StopsRedisAfterOneChunk(FleetClient):
        def outgoing(self, envs: Any, ids: Any, inputs_json: Any = None) -> Iterator[Any]:
            ids = list(ids)
            first = ids[:CHUNK]
            for i, m in enumerate(super().outgoing(envs, ids, inputs_json)):
                if i == CHUNK:  # the first chunk is sent; the next one is being built
                    # Redis has taken it (its reply is written) before it is stopped
                    wait_for(lambda: taken(pstack, first) >= CHUNK, "the first chunk on Redis")
                    pstack.stop("redis")
                yield m

    client = StopsRedisAfterOneChunk(pstack.s)
    requests = [SubmitRequest("text", {"text": words(400 + i)}, "bulk") for i in range(2 * CHUNK)]
    try:
        with pytest.raises(BrokerUnavailable) as err:
            client.submit_many(requests)
        assert err.value.reason == "UNREACHABLE"
        sent = err.value.submitted  # type: ignore[attr-defined]
        assert [h.envelope.inputs for h in sent] == [r.inputs for r in requests[:CHUNK]]
    finally:
        client.close()
        pstack.start_redis()
    assert_each_ran_once(pclient, pstack, sent)


def test_submit_many_survives_connections_killed_while_it_sends(
    pclient: FleetClient, pstack: Any
) -> None:
    """Kills at random moments: before a chunk, while it is sent, while its reply is read."""
    done = threading.Event()
    kills: list[int] = []

    def killer() -> None:
        while not done.is_set():
            kills.append(kill_producer_connections(pstack))
            time.sleep(0.02)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        handles = pclient.submit_many(
            SubmitRequest("text", {"text": words(300 + i)}, "bulk") for i in range(1500)
        )
    finally:
        done.set()
        t.join()
    assert len(handles) == 1500 and sum(kills) >= 1, kills
    assert_each_ran_once(pclient, pstack, handles)
