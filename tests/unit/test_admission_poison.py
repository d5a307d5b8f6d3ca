"""``workers.batching.admission``: a received request ->
pending or a coded refusal; a message that keeps killing workers is refused; a suspect runs alone.

A fake model and fake requests; the blame records are kept in a dict with the Redis semantics
of ``workers.batching.admission`` (``engine_fakes.MemoryCounters``); the real scripts on a real
Redis are covered by tests/integration/test_blame_records.py, real worker crashes by
tests/integration/test_faults.py.
"""

from __future__ import annotations

import time

from engine_fakes import MODALITY, Doubler, FakeReq, MemoryCounters, envelope

from shared.errors import FleetError, WorkerLost
from shared.schema import Priority, TaskEnvelope
from shared.settings import Settings
from shared.tracing import Tracing
from workers.batching.admission import Admission, Deliveries, Refusal, Served, screen
from workers.batching.batcher import Batcher, Pending, Policy, Work
from workers.batching.inject import RequestInjector

SERVED = Served(MODALITY, "minilm")


def no_store() -> object:
    raise AssertionError("inputs without /dev/shm refs never open the store")


def admission(counters: MemoryCounters, max_deliveries: int = 3) -> Admission:
    deliveries = Deliveries(counters, max_deliveries=max_deliveries)
    return Admission(
        Doubler(), deliveries, RequestInjector(False), Tracing(Settings(), MODALITY), no_store
    )


def deliver(adm: Admission, tid: str, x: object = 1) -> Pending | FleetError:
    """One delivery as the engine's front door handles it: record, admit, unrecord."""
    [count] = adm.deliveries.arrive([tid])
    got = adm.admit(FakeReq(tid), envelope(x), count)
    adm.deliveries.decoded([tid])
    return got


def run_and_die(adm: Admission, pending: Pending) -> None:
    """Its batch's record names it; the worker then dies (no result, records left)."""
    run, dups = adm.deliveries.begin([pending.item])
    assert run == [pending.item] and dups == []
    adm.deliveries.counters.die()  # type: ignore[attr-defined]


# -- screen ----------------------------------------------------------------------------------
def test_screen_passes_a_good_envelope() -> None:
    env = screen((), envelope(1).to_kwargs(), SERVED)
    assert not isinstance(env, Refusal) and env.inputs == {"x": 1}


def test_screen_refuses_with_codes_and_a_bounded_priority_label() -> None:
    kw = envelope(1).to_kwargs()
    cases = {
        "positional": (screen((1,), kw, SERVED), "INVALID_INPUT", "unknown"),
        "schema": (screen((), {"request": {"v": 1}}, SERVED), "INVALID_INPUT", "unknown"),
        "priority": (
            screen((), envelope(1, priority="urgent!").to_kwargs(), SERVED),
            "INVALID_PRIORITY",
            "unknown",
        ),
        "modality": (screen((), kw, Served("image", "minilm")), "UNSUPPORTED_MODALITY", "normal"),
        "model": (  # MODEL_NOT_FOUND is bad input (an InvalidInput): never retried
            screen((), envelope(1, model="other").to_kwargs(), SERVED),
            "MODEL_NOT_FOUND",
            "normal",
        ),
        "default model not served": (  # a worker of bge-small alone: null means minilm
            screen((), kw, Served(MODALITY, "minilm", ("bge-small",))),
            "MODEL_NOT_FOUND",
            "normal",
        ),
        "deadline": (
            screen((), envelope(1, deadline_ms=time.time() * 1000 - 1).to_kwargs(), SERVED),
            "DEADLINE_EXCEEDED",
            "normal",
        ),
    }
    for name, (got, code, label) in cases.items():
        assert isinstance(got, Refusal), name
        assert (got.error.code, got.priority) == (code, label), name
    both = Served(MODALITY, "minilm", ("minilm", "bge-small"))
    for model in (None, "minilm", "bge-small"):  # a worker of both takes either, and null
        assert isinstance(screen((), envelope(1, model=model).to_kwargs(), both), TaskEnvelope)


# -- admit -----------------------------------------------------------------------------------
def test_admit_builds_the_pending_request_the_batcher_sees() -> None:
    adm = admission(MemoryCounters())
    got = adm.admit(FakeReq("t1"), envelope(4, priority="high"), count=1)
    assert isinstance(got, Pending) and isinstance(got.item, Work)
    assert (got.id, got.priority, got.bucket, got.nbytes) == ("t1", Priority.HIGH, "b", 8)
    assert got.item.prepared.payload == 4 and got.arrival_s == got.item.arrival_s


def test_admit_refuses_bad_input_with_its_code_and_an_adapter_bug_as_invalid_input() -> None:
    adm = admission(MemoryCounters())
    req = FakeReq("t1")
    got = adm.admit(req, envelope(1).model_copy(update={"inputs": {"y": 1}}), count=1)
    assert isinstance(got, FleetError) and got.code == "INVALID_INPUT"

    def broken(inputs: dict[str, object]) -> object:
        raise KeyError("a bug in the adapter")

    adm.adapter.prepare = broken  # type: ignore[method-assign]
    got = adm.admit(req, envelope(1), count=1)
    assert isinstance(got, FleetError) and got.code == "INVALID_INPUT"
    assert "could not be prepared" in got.message


# -- poison accounting -----------------------------------------------------------------------
def test_a_request_that_killed_its_worker_max_times_is_refused_worker_lost() -> None:
    counters = MemoryCounters()
    adm = admission(counters, max_deliveries=3)
    for _ in range(3):  # three workers die running it
        pending = deliver(adm, "t1")
        assert isinstance(pending, Pending)
        run_and_die(adm, pending)
    got = deliver(adm, "t1")
    assert isinstance(got, WorkerLost) and got.code == "WORKER_LOST"
    assert "lost 3 times" in got.message


def test_a_request_that_finished_or_was_given_back_is_not_counted_as_a_death() -> None:
    counters = MemoryCounters()
    adm = admission(counters, max_deliveries=1)
    pending = deliver(adm, "t1")
    assert isinstance(pending, Pending)
    adm.deliveries.begin([pending.item])
    adm.deliveries.release([pending.item])  # a shutdown gave it back unrun: not a death
    counters.die()  # the worker stopped; the next one starts
    again = deliver(adm, "t1")
    assert isinstance(again, Pending) and again.bucket == "b"  # not even a suspect
    adm.deliveries.begin([again.item])
    counters.store_final("t1")  # it finished
    assert isinstance(deliver(adm, "t1"), Pending)


def test_a_suspect_runs_in_a_batch_of_its_own() -> None:
    counters = MemoryCounters()
    adm = admission(counters)
    first = deliver(adm, "suspect")
    assert isinstance(first, Pending)
    run_and_die(adm, first)
    batcher = Batcher(Policy(max_batch_size=8, max_queue_delay_ms=0.0))
    suspect = deliver(adm, "suspect")
    innocents = [deliver(adm, f"i{n}") for n in range(3)]
    for p in (suspect, *innocents):
        assert isinstance(p, Pending)
        batcher.add(p)
    now = time.monotonic() + 1.0
    batches = []
    while len(batcher):
        batches.append(sorted(p.id for p in batcher.next_batch(now).batch))
    assert sorted(batches) == [["i0", "i1", "i2"], ["suspect"]]


def test_a_duplicate_with_a_final_result_is_not_run_and_others_are_recorded_once() -> None:
    counters = MemoryCounters()
    adm = admission(counters)
    a, b = deliver(adm, "a"), deliver(adm, "b")
    assert isinstance(a, Pending) and isinstance(b, Pending)
    counters.store_final("a")
    run, dups = adm.deliveries.begin([a.item, b.item])
    assert [w.req.id for w in run] == ["b"] and [w.req.id for w in dups] == ["a"]
    assert b.item.counted and counters.named("b") == 1 and counters.named("a") == 0
    adm.deliveries.begin([b.item])  # a retry in the same delivery: the lane's record again
    assert counters.named("b") == 1


def test_redis_away_never_stops_a_request() -> None:
    counters = MemoryCounters()
    adm = admission(counters)
    counters.down = True
    got = deliver(adm, "t1")  # not recorded at arrival: runs, not as a suspect
    assert isinstance(got, Pending) and got.bucket == "b"
    run, dups = adm.deliveries.begin([got.item])
    assert run == [got.item] and dups == [] and not got.item.counted
    counters.down = False
    run, _ = adm.deliveries.begin([got.item])  # recorded at its batch
    assert got.item.counted and counters.named("t1") == 1
