"""``workers.batching.execution``: one batch -> every member's outcome, without Redis or Celery.

A fake model (``engine_fakes.Doubler``: ``y = 2 * x``, misbehaving on chosen inputs) and
fake requests; the runner, circuit breaker, retry policy and latency model are the real
ones. The clock is moved by hand; nothing sleeps.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from engine_fakes import Doubler, Rig, codes, finals, rig, work

from shared.errors import (
    DeviceOOM,
    InvalidInput,
    ModelError,
    TransientError,
)
from workers.batching.batcher import Work
from workers.batching.completion import Done, Retry, Started
from workers.batching.execution import RetryPolicy, as_fleet_error

REPO = Path(__file__).resolve().parents[2]


def retries(r: Rig) -> list[Retry]:
    return [i for i in r.posted if isinstance(i, Retry)]


def batch(adapter: Doubler, *xs: Any) -> list[Work]:
    return [work(f"r{i}", x, adapter) for i, x in enumerate(xs)]


# -- bisection ------------------------------------------------------------------------------
def test_one_poison_request_fails_alone_and_its_batch_mates_get_their_results() -> None:
    r = rig(Doubler())
    r.runner.run(batch(r.adapter, 0, 1, 2, 3, 4, "poison", 6, 7), None)
    out = finals(r)
    assert out["r5"].error is not None and out["r5"].error.code == "MODEL_ERROR"
    assert {tid: o.result for tid, o in out.items() if tid != "r5"} == {
        f"r{i}": {"y": 2 * i} for i in (0, 1, 2, 3, 4, 6, 7)
    }
    # Halves until the poison is alone: 8, then 4 + 4, then 2 + 2 of the failing half, then
    # 1 + 1 of the failing pair; clean halves run once each.
    assert [len(c) for c in r.adapter.calls] == [8, 4, 4, 2, 1, 1, 2]


def test_an_input_error_found_by_bisection_keeps_its_code() -> None:
    r = rig(Doubler())
    r.runner.run(batch(r.adapter, 1, "bad", 3), None)
    assert codes(r) == {"r0": "ok", "r1": "INVALID_INPUT", "r2": "ok"}


def test_a_preprocess_failure_fails_that_request_alone_before_the_model_runs() -> None:
    r = rig(Doubler())
    r.runner.run(batch(r.adapter, 1, "undecodable", "garbled", 4), None)
    assert codes(r) == {"r0": "ok", "r1": "IMAGE_DECODE", "r2": "INVALID_INPUT", "r3": "ok"}
    assert r.adapter.calls == [[1, 4]]  # only the preprocessed ones reach the model


# -- out of memory ---------------------------------------------------------------------------
def test_an_oom_batch_is_split_and_its_halves_rerun() -> None:
    r = rig(Doubler(capacity=2))
    r.runner.run(batch(r.adapter, 1, 2, 3, 4), None)
    assert {tid: o.result for tid, o in finals(r).items()} == {
        "r0": {"y": 2},
        "r1": {"y": 4},
        "r2": {"y": 6},
        "r3": {"y": 8},
    }
    assert r.adapter.calls == [[1, 2, 3, 4], [1, 2], [3, 4]]


def test_a_request_that_does_not_fit_even_alone_fails_device_oom() -> None:
    r = rig(Doubler(capacity=2))
    r.runner.run(batch(r.adapter, 1, "huge", 3, 4), None)
    assert codes(r) == {"r0": "ok", "r1": "DEVICE_OOM", "r2": "ok", "r3": "ok"}


def test_fault_classification() -> None:
    assert isinstance(as_fleet_error(RuntimeError("CUDA out of memory")), DeviceOOM)

    class OutOfMemoryError(RuntimeError):  # torch's type name, any message
        pass

    assert isinstance(as_fleet_error(OutOfMemoryError("alloc failed")), DeviceOOM)
    assert isinstance(as_fleet_error(IndexError("index 3")), ModelError)
    err = InvalidInput("x")
    assert as_fleet_error(err) is err


# -- retries ---------------------------------------------------------------------------------
def test_retry_policy_doubles_the_backoff_within_the_budget() -> None:
    p = RetryPolicy(max_retries=3, backoff_s=0.5)
    t = TransientError("busy")
    assert [p.countdown_s(t, a) for a in range(4)] == [0.5, 1.0, 2.0, None]
    assert p.countdown_s(ModelError("x"), 0) is None  # not retryable
    assert p.countdown_s(InvalidInput("x"), 0) is None
    assert p.countdown_s(None, 0) is None  # a success is final


def test_a_transient_fault_is_retried_after_its_backoff_and_then_succeeds() -> None:
    r = rig(Doubler(flaky_failures=2), backoff_s=0.5)
    first = batch(r.adapter, 5, "flaky")
    r.runner.run(first, None)
    # The batch failed, its halves ran: the batch-mate succeeded, the flaky one is retried.
    assert codes(r) == {"r0": "ok"}
    [retry] = retries(r)
    assert (retry.work.req.id, retry.countdown_s, retry.error.code) == ("r1", 0.5, "TRANSIENT")
    [pending] = r.scheduled
    assert pending.id == "r1" and pending.arrival_s == r.clock.now + 0.5
    assert pending.item.attempts == 1 and r.stats.retried == 1
    r.runner.run([pending.item], None)
    assert finals(r)["r1"].result == {"y": "ok"}


def test_the_retry_budget_ends_in_a_transient_failure() -> None:
    r = rig(Doubler(flaky_failures=100), max_retries=2, backoff_s=0.5)
    w = work("r0", "flaky", r.adapter)
    for _ in range(3):
        r.runner.run([w], None)
    assert [x.countdown_s for x in retries(r)] == [0.5, 1.0]
    assert codes(r) == {"r0": "TRANSIENT"}
    assert len(r.scheduled) == 2 and r.stats.retried == 2 and w.attempts == 2


def test_a_model_fault_is_not_retried() -> None:
    r = rig(Doubler(), max_retries=5)
    r.runner.run(batch(r.adapter, "poison"), None)
    assert codes(r) == {"r0": "MODEL_ERROR"}
    assert retries(r) == [] and r.scheduled == []


# -- the gate, labels, latency ---------------------------------------------------------------
def test_only_what_the_gate_lets_through_runs_and_is_announced() -> None:
    r = rig(Doubler(), gate=lambda b: [w for w in b if w.req.id != "r1"])
    r.runner.run(batch(r.adapter, 1, 2, 3), None)
    [started] = [i for i in r.posted if isinstance(i, Started)]
    assert [w.req.id for w in started.batch] == ["r0", "r2"]
    assert r.adapter.calls == [[1, 3]] and set(finals(r)) == {"r0", "r2"}


def test_members_are_labelled_with_one_batch_and_clean_batches_feed_the_latency_model() -> None:
    r = rig(Doubler())
    first, second = batch(r.adapter, 1, 2), batch(r.adapter, 1, 2, 3)
    r.runner.run(first, None)
    r.runner.run(second, None)
    assert {w.batch_id for w in first} == {"test-1"} and {w.batch_size for w in first} == {2}
    assert all(w.started_s == r.clock.now for w in first + second)
    # Two distinct clean sizes observed: the model now predicts (it did not before).
    assert r.runner.latency.predict_s("b", 4) is not None
    assert r.stats.batch_sizes == {2: 1, 3: 1}


def test_a_batch_with_a_failure_does_not_feed_the_latency_model() -> None:
    r = rig(Doubler())
    r.runner.run(batch(r.adapter, 1, 2), None)
    r.runner.run(batch(r.adapter, 1, "poison", 3), None)
    assert r.runner.latency.predict_s("b", 4) is None


# -- suspects run after what ran before them is settled, and settle before what follows -----
def test_a_suspect_batch_runs_after_earlier_outcomes_are_stored_and_stores_its_own_first() -> None:
    """A batch that ended but whose results the loop had not yet stored was blamed for the
    death its suspect successor caused (test_faults: an innocent ran just before the
    poison's redelivery, and collected three deaths)."""
    seen: list[tuple[str, int, bool]] = []  # (what, items posted so far, suspect running)

    def settled(timeout_s: float) -> bool:
        seen.append(("settled", len(r.posted), r.runner.isolation.snapshot()["suspects"] > 0))
        return True

    def gate(b: list[Work]) -> list[Work]:
        seen.append(("gate", len(r.posted), r.runner.isolation.snapshot()["suspects"] > 0))
        return b

    r = rig(Doubler(), gate=gate, settled=settled)
    r.runner.run(batch(r.adapter, 1, 2), None)  # an ordinary batch waits for nothing
    assert seen == [("gate", 0, False)]
    before = len(r.posted)  # Started + 2 Done
    suspect = batch(r.adapter, 3)
    suspect[0].suspect = True
    r.runner.run(suspect, None)
    after = len(r.posted)  # + Started + Done
    assert after == before + 2
    assert seen[1:] == [
        ("settled", before, True),  # the batch before it stored, before it is counted
        ("gate", before, True),
        ("settled", after, True),  # its own outcome posted and stored while still alone
    ]


def test_a_stuck_loop_delays_a_suspect_but_does_not_stop_it() -> None:
    r = rig(Doubler(), settled=lambda timeout_s: False)  # the wait timed out
    suspect = batch(r.adapter, 3)
    suspect[0].suspect = True
    r.runner.run(suspect, None)
    assert codes(r) == {"r0": "ok"}


@pytest.mark.parametrize("flaky_failures", [0, 1])
def test_every_member_ends_exactly_once_per_run(flaky_failures: int) -> None:
    r = rig(Doubler(flaky_failures=flaky_failures, capacity=3), max_retries=0)
    r.runner.run(batch(r.adapter, 1, "flaky", 3, "poison", 5, "huge", 7), None)
    ended = [i.req.id for i in r.posted if isinstance(i, Done)]
    assert sorted(ended) == [f"r{i}" for i in range(7)]


def test_the_engine_parts_import_neither_celery_nor_redis() -> None:
    parts = "admission, execution, completion, batcher"
    code = (
        f"import sys; from workers.batching import {parts}; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'celery', 'kombu', 'redis'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert out.stdout.strip() == "[]"
