"""Faults as they happen, on a real stack of its own: leases, one final result per request,
malformed messages, graceful shutdown, revocation, ETA.

A separate Redis and text worker with a short lease (3 s: renewed every 0.6 s, returned
0.3 s after 2.1 s without renewal) and fault injection on; the worker is killed and
restarted here, so the session stack is left alone. Every test counts what happened to each
request: its final state, and how often the worker ran it (the worker's one log line per
finished request, ``request id=<id> state=<STATE>``).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from producer.client import FleetClient, SubmitRequest, outcome_from_meta
from shared import schema
from shared.celery_app import make_app
from tests.conftest import REPO, own_text_stack

pytestmark = pytest.mark.integration

LEASE_S = 3.0


@pytest.fixture(scope="module")
def rstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    overrides = {
        "FLEET_CONFIG": str(REPO / "configs" / "fleet.toml"),
        "FLEET_REDIS__LEASE_S": str(LEASE_S),
        "FLEET_DEBUG__FAULT_INJECTION": "true",
        "FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE": "8",
        "FLEET_MODALITIES__TEXT__BATCHING__LENGTH_BUCKETS": "[16]",
        "FLEET_MODALITIES__TEXT__BATCHING__REALTIME_LANE": "false",
        "FLEET_MODALITIES__TEXT__RETRY_BACKOFF_S": "0.1",
        "FLEET_METRICS__PORT_BASE": "0",
        # RELIABILITY_FETCH_NOTIFY=false: kombu's BRPOP fetch, to see what the other fixes
        "FLEET_REDIS__FETCH_NOTIFY": os.environ.get("RELIABILITY_FETCH_NOTIFY", "true"),
    }
    with own_text_stack(tmp_path_factory, "reliability-run", overrides) as st:
        yield st


@pytest.fixture(scope="module")
def rclient(rstack: Any) -> Iterator[FleetClient]:
    c = FleetClient(rstack.s)
    yield c
    c.close()


@pytest.fixture()
def worker(rstack: Any) -> Iterator[Any]:
    """The stack, with a live text worker before and after the test."""
    if not rstack.alive("worker-text"):
        rstack.start_worker("text")
    yield rstack
    if not rstack.alive("worker-text"):
        rstack.stop("worker-text", timeout_s=1)
        rstack.start_worker("text")


def redis_of(st: Any) -> redis.Redis:
    return redis.Redis.from_url(st.s.redis_url())


def blamed(r: redis.Redis, task_id: str) -> list[str]:
    """The blame records (``workers.batching.admission.InFlight``) that name ``task_id``."""
    names = sorted(n.decode() for n in r.smembers(schema.BLAME_INDEX_KEY))
    return [n for n in names if task_id.encode() in (r.get(n) or b"").split()]


def words(i: int) -> str:
    return f"Sentence number {i} about a quiet river."


def runs(st: Any, task_id: str, state: str = r"\w+") -> int:
    """How many times the worker finished ``task_id`` with ``state`` (its log lines)."""
    text = (st.logs / "worker-text.log").read_text(errors="replace")
    return len(re.findall(rf"request id={re.escape(task_id)} state={state}\b", text))


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> float:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def settled(st: Any) -> bool:
    """Nothing left in the text queues or in kombu's unacked hash."""
    r = redis_of(st)
    queued = sum(
        r.llen(schema.priority_list_key(q, p))
        for q in (schema.queue_name("text"), schema.realtime_queue_name("text"))
        for p in schema.PRIORITY_STEPS
    )
    return queued == 0 and r.hlen(schema.UNACKED_KEY) == 0


def worker_pid(st: Any) -> int:
    pid = st._read_pid(st.pids / "worker-text.pid")
    assert pid is not None
    return pid


def outcome_of(client: FleetClient, task_id: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The stored outcome of any task id (as ``ResultHandle.outcome``)."""
    res = client.app.AsyncResult(task_id)
    res.get(timeout=timeout_s, propagate=False, disable_sync_subtasks=False)
    return outcome_from_meta(res.backend.get_task_meta(task_id))


def republish(client: FleetClient, handle: Any) -> None:
    """Publish another message with the same task id and envelope (a duplicate delivery)."""
    env = handle.envelope
    with client.app.producer_or_acquire() as producer:
        client.publish(producer, env, handle.id, schema.queue_for(env.modality, env.priority), 9)


# -- leases --------------------------------------------------------------------------------
def test_a_batch_longer_than_the_lease_runs_once(rclient: FleetClient, worker: Any) -> None:
    h = rclient.submit("text", {"text": words(1), "_inject": f"slow:{3 * LEASE_S}"}, "bulk")
    assert h.get(60)["dim"] == 384
    wait_for(lambda: settled(worker), "the queue and unacked hash to empty")
    time.sleep(LEASE_S)  # a wrongly restored copy would be fetched and run by now
    assert runs(worker, h.id) == 1, "a live worker's message was handed out again"


def test_a_killed_workers_messages_come_back_and_all_finish(
    rclient: FleetClient, worker: Any
) -> None:
    blocker = rclient.submit("text", {"text": words(2), "_inject": "slow:4"}, "bulk")
    held = rclient.submit_many(
        [SubmitRequest("text", {"text": words(i)}, "bulk") for i in range(30)]
    )
    r = redis_of(worker)
    wait_for(lambda: r.hlen(schema.UNACKED_KEY) >= 31, "the worker to hold all 31")
    os.killpg(worker_pid(worker), signal.SIGKILL)
    killed = time.monotonic()
    worker.stop("worker-text", timeout_s=1)
    worker.start_worker("text")
    restart_s = time.monotonic() - killed
    outs = rclient.wait_all([blocker, *held], timeout_s=LEASE_S + 60)
    assert all(o is not None and "result" in o for o in outs), outs
    print(f"worker restart {restart_s:.1f} s, all final {time.monotonic() - killed:.1f} s")
    # The killed delivery of each is not a final result: one SUCCESS per request.
    assert all(runs(worker, h.id, "SUCCESS") == 1 for h in [blocker, *held])
    wait_for(lambda: settled(worker), "the queue and unacked hash to empty")


def test_liveness_follows_the_worker_through_a_kill_and_a_graceful_stop(
    rclient: FleetClient, worker: Any
) -> None:
    """``live_workers`` (what the gateway's readiness and the CLI's warnings read): a ready
    worker is listed; a SIGKILLed one drops out within the lease; a stopped one at once."""
    node = f"text@{socket.gethostname()}"
    assert rclient.live_workers("text") == [node]
    os.killpg(worker_pid(worker), signal.SIGKILL)
    gone_s = wait_for(lambda: rclient.live_workers("text") == [], "the dead worker to drop out")
    assert gone_s <= LEASE_S + 1
    worker.stop("worker-text", timeout_s=1)
    worker.start_worker("text")
    assert rclient.live_workers("text") == [node]  # announced when ready
    worker.stop("worker-text")  # SIGTERM: withdrawn on the way out
    assert rclient.live_workers("text") == []
    worker.start_worker("text")


def test_a_stopped_worker_loses_its_lease_and_a_live_one_finishes_its_work(
    rclient: FleetClient, worker: Any
) -> None:
    """SIGSTOP (a hung worker): its messages go back when the lease lapses; after SIGCONT its
    own late results do not overwrite the final ones, and nothing is left unacked."""
    hs = rclient.submit_many([SubmitRequest("text", {"text": words(i)}, "bulk") for i in range(5)])
    rclient.wait_all(hs, timeout_s=30)
    blocker = rclient.submit("text", {"text": words(3), "_inject": "slow:2"}, "bulk")
    held = rclient.submit_many(
        [SubmitRequest("text", {"text": words(i)}, "bulk") for i in range(10)]
    )
    r = redis_of(worker)
    wait_for(lambda: r.hlen(schema.UNACKED_KEY) >= 11, "the worker to hold all 11")
    pid = worker_pid(worker)
    os.killpg(pid, signal.SIGSTOP)
    try:
        # Lapsed and returned by nobody yet (no live worker scans): entries age past the lease.
        time.sleep(LEASE_S + 1)
        ages = [
            time.time() - s for _, s in r.zrange(schema.UNACKED_INDEX_KEY, 0, -1, withscores=True)
        ]
        assert ages and min(ages) > worker.s.redis.lease_expiry_s
    finally:
        os.killpg(pid, signal.SIGCONT)
    outs = rclient.wait_all([blocker, *held], timeout_s=60)
    assert all(o is not None and "result" in o for o in outs), outs
    wait_for(lambda: settled(worker), "the queue and unacked hash to empty", 30)


# -- one final result per request ----------------------------------------------------------
def test_a_redelivered_copy_of_a_finished_request_keeps_its_success(
    rclient: FleetClient, worker: Any
) -> None:
    h = rclient.submit("text", {"text": words(4)}, "normal", timeout_s=1.0)
    assert h.get(30)["dim"] == 384
    time.sleep(1.2)  # the copy arrives past its deadline: it would fail DEADLINE_EXCEEDED
    republish(rclient, h)
    wait_for(lambda: runs(worker, h.id, "DUPLICATE") == 1, "the copy to be acked as a duplicate")
    assert h.outcome(5)["result"]["dim"] == 384
    assert runs(worker, h.id, "SUCCESS") == 1 and runs(worker, h.id, "FAILURE") == 0
    wait_for(lambda: settled(worker), "the copy's ack")


def test_a_task_id_delivered_twice_into_the_window_runs_once(
    rclient: FleetClient, worker: Any
) -> None:
    blocker = rclient.submit("text", {"text": words(5), "_inject": "slow:1.5"}, "bulk")
    time.sleep(0.3)  # the blocker's batch runs: the copies wait in the window together
    h = rclient.submit("text", {"text": words(6)}, "bulk")
    for _ in range(3):
        republish(rclient, h)
    assert h.get(30)["dim"] == 384 and blocker.get(30)["dim"] == 384
    wait_for(lambda: settled(worker), "every copy's ack")
    assert runs(worker, h.id, "SUCCESS") == 1, "a copy of a task id ran again"


# -- malformed messages --------------------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    ["not a list", [1, 2], {"args": 1}, [[], "kwargs-not-a-dict", {}]],
)
def test_a_malformed_body_fails_coded_and_the_worker_keeps_serving(
    rclient: FleetClient, worker: Any, body: Any
) -> None:
    pid = worker_pid(worker)
    task_id = str(uuid.uuid4())
    with rclient.app.producer_or_acquire() as producer:
        producer.publish(
            body,
            exchange="",
            routing_key=schema.queue_name("text"),
            headers={"id": task_id, "task": schema.task_name("text"), "lang": "py"},
            serializer="json",
        )
    assert outcome_of(rclient, task_id)["error"]["code"] == "INVALID_MESSAGE"
    assert rclient.submit("text", {"text": words(7)}).get(30)["dim"] == 384
    assert worker_pid(worker) == pid and worker.alive("worker-text")
    wait_for(lambda: settled(worker), "the malformed message's ack")


# -- shutdown, revocation, ETA -------------------------------------------------------------
def test_retries_then_a_sigterm_are_not_deaths(rclient: FleetClient, worker: Any) -> None:
    """Five transient faults (retried in place, 0.1 s doubling) caught by a deploy: the
    worker finishes the request while it shuts down; it never ends ``WORKER_LOST``."""
    h = rclient.submit("text", {"text": words(8), "_inject": "transient:5"}, "bulk")
    time.sleep(2.0)  # five attempts have run and failed; the sixth is due at ~3.1 s
    t0 = time.monotonic()
    worker.stop("worker-text", timeout_s=40)
    print(f"graceful shutdown took {time.monotonic() - t0:.1f} s")
    out = h.outcome(5)
    assert "result" in out, out
    assert not blamed(redis_of(worker), h.id)  # no record names it: nothing to count
    worker.start_worker("text")


def test_sigterm_finishes_what_the_window_holds(rclient: FleetClient, worker: Any) -> None:
    blocker = rclient.submit("text", {"text": words(9), "_inject": "slow:1"}, "bulk")
    held = rclient.submit_many(
        [SubmitRequest("text", {"text": words(i)}, "bulk") for i in range(20)]
    )
    r = redis_of(worker)
    wait_for(lambda: r.hlen(schema.UNACKED_KEY) >= 21, "the worker to hold all 21")
    worker.stop("worker-text", timeout_s=40)
    polled = rclient.poll([blocker, *held])  # final before any other worker started
    assert all(o is not None and "result" in o for o in polled), polled
    assert settled(worker)
    worker.start_worker("text")


def test_a_revoked_request_in_the_window_never_runs(rclient: FleetClient, worker: Any) -> None:
    blocker = rclient.submit("text", {"text": words(10), "_inject": "slow:2"}, "bulk")
    time.sleep(0.3)
    victim, mate = rclient.submit_many(
        [
            SubmitRequest("text", {"text": words(11)}, "bulk"),
            SubmitRequest("text", {"text": words(12)}, "bulk"),
        ]
    )
    r = redis_of(worker)
    wait_for(lambda: r.hlen(schema.UNACKED_KEY) >= 3, "the worker to hold all three")
    # Celery's revoke is a control broadcast: an operator's (Flower's) act, not a producer's
    operator = make_app(worker.s, name="test-operator", role="operator")
    try:
        operator.control.revoke(victim.id)
    finally:
        operator.close()
    assert victim.outcome(30)["error"]["code"] == "REVOKED"
    assert mate.get(30)["dim"] == 384 and blocker.get(30)["dim"] == 384
    assert runs(worker, victim.id, "SUCCESS") == 0
    wait_for(lambda: settled(worker), "the revoked request's ack")


def test_an_eta_message_gets_a_coded_failure(rclient: FleetClient, worker: Any) -> None:
    env = rclient.envelope("text", {"text": words(13)}, "bulk")
    res = rclient.app.send_task(
        schema.task_name("text"),
        kwargs=env.to_kwargs(),
        countdown=1,
        queue=schema.queue_name("text"),
    )
    assert outcome_of(rclient, res.id)["error"]["code"] == "ETA_NOT_SUPPORTED"


# -- Redis and network faults --------------------------------------------------------------
def kill_redis_and_restart(st: Any) -> float:
    """SIGKILL redis-server, start it again on its port from its AOF; seconds it was down."""
    pid = st._read_pid(st.pids / "redis.pid")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    wait_for(lambda: not st.alive("redis"), "redis-server to die", 10)
    st.start_redis()
    return time.monotonic() - t0


def test_a_redis_restart_under_load_is_survived_and_nothing_is_lost(
    rclient: FleetClient, worker: Any
) -> None:
    pid = worker_pid(worker)
    hs = rclient.submit_many(
        [SubmitRequest("text", {"text": words(i)}, "bulk") for i in range(300)]
    )
    r = redis_of(worker)
    wait_for(lambda: r.hlen(schema.UNACKED_KEY) >= 50, "the worker to hold a window")
    down_s = kill_redis_and_restart(worker)
    outs = rclient.wait_all(hs, timeout_s=120)
    assert worker.alive("worker-text") and worker_pid(worker) == pid, worker.log_tail("worker-text")
    assert all(o is not None and "result" in o for o in outs), [
        o for o in outs if not o or "result" not in o
    ][:3]
    twice = sum(runs(worker, h.id, "SUCCESS") > 1 for h in hs)
    print(f"redis down {down_s:.1f} s; {twice} of {len(hs)} ran twice")
    wait_for(lambda: settled(worker), "the queue and unacked hash to empty", 30)


def test_killed_worker_connections_do_not_rerun_what_the_engine_holds(
    rclient: FleetClient, worker: Any
) -> None:
    """``CLIENT KILL`` of every worker connection mid-batch: the worker reconnects; what its
    engine held is neither restored behind its back nor run twice."""
    pid = worker_pid(worker)
    blocker = rclient.submit("text", {"text": words(14), "_inject": "slow:2"}, "bulk")
    hs = rclient.submit_many([SubmitRequest("text", {"text": words(i)}, "bulk") for i in range(60)])
    r = redis_of(worker)
    wait_for(lambda: r.hlen(schema.UNACKED_KEY) >= 61, "the worker to hold all 61")
    me = r.client_id()
    killed = 0
    for c in r.client_list():
        if int(c["id"]) != me and c.get("cmd") not in ("client|list", "client"):
            with contextlib.suppress(redis.RedisError):
                killed += int(r.client_kill_filter(_id=c["id"]))
    assert killed > 0
    outs = rclient.wait_all([blocker, *hs], timeout_s=60)
    assert all(o is not None and "result" in o for o in outs)
    assert worker_pid(worker) == pid and worker.alive("worker-text")
    wait_for(lambda: settled(worker), "the queue and unacked hash to empty", 30)
    assert sum(runs(worker, h.id, "SUCCESS") for h in [blocker, *hs]) == 61, "some ran twice"


def _restart_until_failed(handle: Any, worker: Any) -> int:
    """Restart the text worker each time it dies until ``handle`` has failed (at most 6
    restarts, 180 s); how many restarts it took."""
    from producer.stack.local import StackError

    restarts = 0
    end = time.monotonic() + 180
    while handle.state() != "FAILURE" and time.monotonic() < end and restarts < 6:
        if not worker.alive("worker-text"):
            worker.stop("worker-text", timeout_s=1)
            restarts += 1
            with contextlib.suppress(StackError):
                worker.start_worker("text")
        time.sleep(0.1)
    return restarts


def test_a_message_that_kills_the_worker_while_decoding_ends_worker_lost(
    rclient: FleetClient, worker: Any
) -> None:
    """A death before any batch ran (a media header crashing a decoder) counts too: after
    three such deaths the fourth delivery fails ``WORKER_LOST`` instead of a crash loop."""
    poison = rclient.submit("text", {"text": words(15), "_inject": "crash_prepare"}, "bulk")
    innocent = rclient.submit("text", {"text": words(16)}, "bulk")
    restarts = _restart_until_failed(poison, worker)
    assert poison.outcome(5)["error"]["code"] == "WORKER_LOST"
    assert restarts == 3  # three deliveries died decoding it; the fourth was refused
    if not worker.alive("worker-text"):
        worker.start_worker("text")
    assert innocent.get(60)["dim"] == 384


def test_an_innocent_arriving_with_a_decoder_killing_message_is_not_blamed(
    rclient: FleetClient, worker: Any
) -> None:
    """The poison and an innocent in one ``submit_many`` (one transaction, so one arrival
    group): the first death counts against both, but from then on each suspect is decoded
    alone, so the innocent is not blamed for the poison's later deaths and runs."""
    poison, innocent = rclient.submit_many(
        [
            SubmitRequest("text", {"text": words(17), "_inject": "crash_prepare"}, "bulk"),
            SubmitRequest("text", {"text": words(18)}, "bulk"),
        ]
    )
    restarts = _restart_until_failed(poison, worker)
    assert poison.outcome(5)["error"]["code"] == "WORKER_LOST"
    assert restarts == 3
    if not worker.alive("worker-text"):
        worker.start_worker("text")
    assert innocent.get(60)["dim"] == 384


def in_redis(r: redis.Redis, task_id: str) -> bool:
    """Whether a message of ``task_id`` is in Redis: queued, or in kombu's unacked hash."""
    needle = task_id.encode()
    lists = [
        schema.priority_list_key(q, p)
        for q in (schema.queue_name("text"), schema.realtime_queue_name("text"))
        for p in schema.PRIORITY_STEPS
    ]
    queued = any(needle in item for k in lists for item in r.lrange(k, 0, -1))
    return queued or any(needle in e for e in r.hvals(schema.UNACKED_KEY))


def test_a_message_is_never_only_in_a_killed_workers_socket(
    rclient: FleetClient, worker: Any
) -> None:
    """An idle worker waits for messages without popping one (BRPOP would hand the next
    message over the socket at once, out of Redis, and a kill then loses it)."""
    wait_for(lambda: settled(worker), "an idle worker")
    pid = worker_pid(worker)
    os.killpg(pid, signal.SIGSTOP)
    try:
        h = rclient.submit("text", {"text": words(17)}, "bulk")
        time.sleep(0.5)
        assert in_redis(redis_of(worker), h.id), "the message left Redis unrecorded"
    finally:
        os.killpg(pid, signal.SIGKILL)
        os.killpg(pid, signal.SIGCONT)
    worker.stop("worker-text", timeout_s=1)
    worker.start_worker("text")
    assert h.get(60)["dim"] == 384
