"""The batching contract of ``workers.batching.batcher``, case by case, as pure logic.

Every call passes an explicit monotonic ``now`` (seconds); nothing sleeps. Each trigger test
sets the other knobs so that only the trigger under test can fire (a long
``max_queue_delay_ms``, a large ``max_batch_size`` and ``max_batch_bytes``, no window).
"""

from __future__ import annotations

import pytest

from shared.schema import Priority
from workers.batching.batcher import Batcher, Decision, Lane, LatencyModel, Pending, Policy, Trigger

RT, HIGH, NORMAL, BULK = Priority.REALTIME, Priority.HIGH, Priority.NORMAL, Priority.BULK

# Knobs under which no trigger fires for a few NORMAL requests at now == arrival.
QUIET = {
    "max_batch_size": 64,
    "max_queue_delay_ms": 1000.0,
    "max_batch_bytes": 1 << 30,
    "max_high_waiting": 100,
    "window_size": 0,
}


def req(
    rid: str,
    priority: Priority = NORMAL,
    at: float = 0.0,
    deadline: float | None = None,
    bucket: str = "b",
    nbytes: int = 0,
) -> Pending:
    return Pending(
        id=rid, priority=priority, arrival_s=at, deadline_s=deadline, bucket=bucket, nbytes=nbytes
    )


def batcher(*reqs: Pending, model: LatencyModel | None = None, **knobs: float) -> Batcher:
    b = Batcher(Policy(**{**QUIET, **knobs}), model)  # type: ignore[arg-type]
    for r in reqs:
        b.add(r)
    return b


def ids(d: Decision) -> list[str]:
    return [p.id for p in d.batch]


def fitted(ms_per_request: float = 5.0) -> LatencyModel:
    """A model fitted to exactly ``ms_per_request * n`` milliseconds (intercept 0)."""
    m = LatencyModel()
    m.observe("b", 1, ms_per_request / 1e3)
    m.observe("b", 32, 32 * ms_per_request / 1e3)
    return m


# -- ordering ---------------------------------------------------------------------------


def test_higher_priority_runs_before_earlier_arrival() -> None:
    b = batcher(req("n", NORMAL, at=0.0), req("h", HIGH, at=0.5), req("k", BULK, at=0.1))
    d = b.next_batch(now=2.0)
    assert ids(d) == ["h", "n", "k"]


def test_same_priority_runs_in_arrival_order_not_add_order() -> None:
    b = batcher(req("late", at=0.3), req("early", at=0.1), req("mid", at=0.2))
    assert ids(b.next_batch(now=2.0)) == ["early", "mid", "late"]


def test_same_priority_and_arrival_runs_in_add_order() -> None:
    b = batcher(req("first", at=0.1), req("second", at=0.1), req("third", at=0.1))
    assert ids(b.next_batch(now=2.0)) == ["first", "second", "third"]


def test_batch_holds_only_the_heads_bucket() -> None:
    b = batcher(
        req("a1", HIGH, at=0.0, bucket="a"),
        req("b1", NORMAL, at=0.0, bucket="b"),
        req("a2", NORMAL, at=0.0, bucket="a"),
    )
    d = b.next_batch(now=2.0)
    assert ids(d) == ["a1", "a2"]
    assert len(b) == 1


def test_lower_priority_in_other_bucket_waits_even_when_its_delay_passed() -> None:
    # b1's delay ran out at 0.002, but the head is the HIGH request of bucket a (not ready).
    b = batcher(
        req("b1", NORMAL, at=0.0, bucket="b"),
        req("a1", HIGH, at=0.010, bucket="a"),
        max_queue_delay_ms=2.0,
    )
    d = b.next_batch(now=0.011)
    assert d.batch == []
    wake = d.wake_at_s
    assert wake == pytest.approx(0.012)
    assert ids(b.next_batch(now=wake)) == ["a1"]
    assert ids(b.next_batch(now=wake)) == ["b1"]


# -- FULL -------------------------------------------------------------------------------


def test_full_fires_at_max_batch_size() -> None:
    b = batcher(*(req(f"r{i}") for i in range(4)), max_batch_size=4)
    d = b.next_batch(now=0.0)
    assert d.trigger is Trigger.FULL
    assert ids(d) == ["r0", "r1", "r2", "r3"]


def test_full_does_not_fire_one_below_max_batch_size() -> None:
    b = batcher(*(req(f"r{i}") for i in range(3)), max_batch_size=4)
    d = b.next_batch(now=0.0)
    assert (d.batch, d.trigger) == ([], None)
    assert len(b) == 3


def test_full_batch_is_capped_at_max_batch_size() -> None:
    b = batcher(*(req(f"r{i}", at=i * 1e-4) for i in range(6)), max_batch_size=4)
    d = b.next_batch(now=0.001)
    assert ids(d) == ["r0", "r1", "r2", "r3"]
    assert len(b) == 2


def test_full_counts_only_the_heads_bucket() -> None:
    b = batcher(
        req("a1", bucket="a"),
        req("b1", at=0.1, bucket="b"),
        req("b2", at=0.1, bucket="b"),
        max_batch_size=2,
    )
    d = b.next_batch(now=0.1)
    assert (d.batch, d.trigger) == ([], None)


# -- DELAY ------------------------------------------------------------------------------


def test_delay_waits_just_before_and_wakes_at_oldest_plus_delay() -> None:
    b = batcher(req("r0", at=0.0), req("r1", at=0.001), max_queue_delay_ms=2.0)
    d = b.next_batch(now=0.0019)
    assert (d.batch, d.trigger) == ([], None)
    assert d.wake_at_s == pytest.approx(0.002)


def test_delay_fires_when_oldest_waited_max_queue_delay() -> None:
    b = batcher(req("r0", at=0.0), req("r1", at=0.001), max_queue_delay_ms=2.0)
    d = b.next_batch(now=0.002)
    assert d.trigger is Trigger.DELAY
    assert ids(d) == ["r0", "r1"]
    assert d.wake_at_s is None


def test_zero_delay_flushes_at_once() -> None:
    b = batcher(req("r0", at=5.0), max_queue_delay_ms=0.0)
    assert b.next_batch(now=5.0).trigger is Trigger.DELAY


# -- REALTIME ---------------------------------------------------------------------------


def test_realtime_request_flushes_immediately() -> None:
    b = batcher(req("n", NORMAL, at=0.0), req("rt", RT, at=0.0))
    d = b.next_batch(now=0.0)
    assert d.trigger is Trigger.REALTIME
    assert ids(d) == ["rt", "n"]


def test_without_realtime_the_same_requests_wait() -> None:
    b = batcher(req("n", NORMAL, at=0.0), req("h", HIGH, at=0.0))
    assert b.next_batch(now=0.0).trigger is None


# -- HIGH -------------------------------------------------------------------------------


def test_high_fires_when_more_than_max_high_waiting() -> None:
    b = batcher(*(req(f"h{i}", HIGH) for i in range(3)), max_high_waiting=2)
    d = b.next_batch(now=0.0)
    assert d.trigger is Trigger.HIGH
    assert ids(d) == ["h0", "h1", "h2"]


def test_high_does_not_fire_at_exactly_max_high_waiting() -> None:
    b = batcher(*(req(f"h{i}", HIGH) for i in range(2)), req("n"), max_high_waiting=2)
    d = b.next_batch(now=0.0)
    assert (d.batch, d.trigger) == ([], None)


# -- MEMORY -----------------------------------------------------------------------------


def test_memory_fires_when_bucket_reaches_max_batch_bytes() -> None:
    b = batcher(req("r0", nbytes=50), req("r1", nbytes=50), max_batch_bytes=100)
    d = b.next_batch(now=0.0)
    assert d.trigger is Trigger.MEMORY
    assert ids(d) == ["r0", "r1"]


def test_memory_does_not_fire_just_below_max_batch_bytes() -> None:
    b = batcher(req("r0", nbytes=50), req("r1", nbytes=49), max_batch_bytes=100)
    assert b.next_batch(now=0.0).trigger is None


def test_batch_never_exceeds_max_batch_bytes() -> None:
    b = batcher(
        req("r0", at=0.0, nbytes=40),
        req("r1", at=0.1, nbytes=40),
        req("r2", at=0.2, nbytes=40),
        req("r3", at=0.3, nbytes=40),
        max_batch_bytes=100,
    )
    d = b.next_batch(now=0.3)
    assert ids(d) == ["r0", "r1"]
    assert sum(p.nbytes for p in d.batch) <= 100
    assert ids(b.next_batch(now=2.0)) == ["r2", "r3"]


def test_head_larger_than_max_batch_bytes_runs_alone() -> None:
    b = batcher(req("big", at=0.0, nbytes=150), req("small", at=0.1, nbytes=1), max_batch_bytes=100)
    d = b.next_batch(now=0.1)
    assert d.trigger is Trigger.MEMORY
    assert ids(d) == ["big"]
    assert len(b) == 1


# -- DEADLINE ---------------------------------------------------------------------------


def test_deadline_before_flush_time_flushes_now() -> None:
    # flush_at = 0.010; waiting would miss the deadline at 0.005.
    b = batcher(req("r", at=0.0, deadline=0.005), max_queue_delay_ms=10.0)
    d = b.next_batch(now=0.0)
    assert d.trigger is Trigger.DEADLINE
    assert ids(d) == ["r"]


def test_ample_deadline_does_not_flush() -> None:
    b = batcher(req("r", at=0.0, deadline=1.0), max_queue_delay_ms=10.0)
    d = b.next_batch(now=0.0)
    assert (d.batch, d.trigger) == ([], None)
    assert d.wake_at_s == pytest.approx(0.010)


def test_deadline_counts_predicted_run_time() -> None:
    # flush_at 0.010 <= deadline 0.012, but a batch of 2 is predicted to take 0.010 s.
    unfitted = batcher(req("r", at=0.0, deadline=0.012), max_queue_delay_ms=10.0)
    assert unfitted.next_batch(now=0.0).trigger is None
    with_model = batcher(
        req("r", at=0.0, deadline=0.012), model=fitted(5.0), max_queue_delay_ms=10.0
    )
    assert with_model.next_batch(now=0.0).trigger is Trigger.DEADLINE


def test_deadline_of_any_bucket_member_counts() -> None:
    b = batcher(
        req("r0", at=0.0, deadline=None),
        req("r1", at=0.001, deadline=0.005),
        max_queue_delay_ms=10.0,
    )
    d = b.next_batch(now=0.001)
    assert d.trigger is Trigger.DEADLINE
    assert ids(d) == ["r0", "r1"]


# -- WINDOW -----------------------------------------------------------------------------


def test_window_fires_when_prefetch_window_is_full() -> None:
    b = batcher(req("a1", bucket="a"), req("b1", bucket="b"), req("b2", bucket="b"), window_size=3)
    d = b.next_batch(now=0.0)
    assert d.trigger is Trigger.WINDOW
    assert ids(d) == ["a1"]


def test_window_does_not_fire_one_below_window_size() -> None:
    b = batcher(req("r0"), req("r1"), window_size=3)
    assert b.next_batch(now=0.0).trigger is None


# -- expiry -----------------------------------------------------------------------------


def test_expired_request_is_returned_and_never_batched() -> None:
    b = batcher(req("old", at=0.0, deadline=0.5), req("ok", at=0.0, deadline=None))
    d = b.next_batch(now=1.0)
    assert [p.id for p in d.expired] == ["old"]
    assert "old" not in ids(d)
    assert ids(d) == ["ok"]
    assert len(b) == 0


def test_only_expired_requests_give_no_batch_and_no_wake() -> None:
    b = batcher(req("old", at=0.0, deadline=0.5))
    d = b.next_batch(now=0.6)
    assert [p.id for p in d.expired] == ["old"]
    assert (d.batch, d.trigger, d.wake_at_s) == ([], None, None)
    assert len(b) == 0


def test_request_at_its_deadline_is_not_yet_expired() -> None:
    b = batcher(req("r", at=0.0, deadline=0.5))
    d = b.next_batch(now=0.5)
    assert d.expired == []
    assert ids(d) == ["r"]


def test_no_deadline_never_expires() -> None:
    b = batcher(req("r", at=0.0, deadline=None))
    d = b.next_batch(now=1e9)
    assert d.expired == []
    assert ids(d) == ["r"]


def test_expired_request_is_reported_once() -> None:
    b = batcher(req("old", at=0.0, deadline=0.5), req("wait", at=0.6))
    assert [p.id for p in b.next_batch(now=0.6).expired] == ["old"]
    assert b.next_batch(now=0.7).expired == []


# -- REALTIME size cap ------------------------------------------------------------------


def test_realtime_caps_batch_to_the_latency_budget() -> None:
    # 5 ms per request, budget 25 ms -> at most 5 requests.
    normals = [req(f"n{i}", at=0.0) for i in range(9)]
    b = batcher(req("rt", RT, at=0.0), *normals, model=fitted(5.0), realtime_budget_ms=25.0)
    d = b.next_batch(now=0.0)
    assert ids(d) == ["rt", "n0", "n1", "n2", "n3"]
    assert b.model.predict_s("b", len(d.batch)) <= 0.025
    assert b.model.predict_s("b", len(d.batch) + 1) > 0.025


def test_realtime_cap_holds_within_grace_after_realtime_left() -> None:
    b = batcher(req("rt", RT, at=0.0), model=fitted(5.0), realtime_budget_ms=25.0)
    assert ids(b.next_batch(now=0.0)) == ["rt"]
    for i in range(9):
        b.add(req(f"n{i}", at=0.9))
    d = b.next_batch(now=1.0)  # exactly realtime_grace_s (1.0) after the REALTIME arrival
    assert d.trigger is Trigger.FULL
    assert len(d.batch) == 5


def test_realtime_cap_is_lifted_after_grace() -> None:
    b = batcher(req("rt", RT, at=0.0), model=fitted(5.0), realtime_budget_ms=25.0)
    assert ids(b.next_batch(now=0.0)) == ["rt"]
    for i in range(9):
        b.add(req(f"n{i}", at=1.0))
    d = b.next_batch(now=1.001)
    assert d.trigger is None  # 9 < max_batch_size 64: no longer FULL at the cap
    d = b.next_batch(now=2.0)
    assert d.trigger is Trigger.DELAY
    assert len(d.batch) == 9


def test_realtime_cap_needs_a_fitted_model() -> None:
    normals = [req(f"n{i}", at=0.0) for i in range(9)]
    b = batcher(req("rt", RT, at=0.0), *normals, realtime_budget_ms=25.0)
    assert len(b.next_batch(now=0.0).batch) == 10


def test_size_cap_is_max_batch_size_without_realtime() -> None:
    b = batcher(model=fitted(5.0), max_batch_size=32, realtime_budget_ms=25.0)
    assert b.size_cap("b", now=0.0) == 32


# -- LatencyModel -----------------------------------------------------------------------


def test_latency_model_recovers_linear_fit() -> None:
    m = LatencyModel()
    for n in (1, 2, 4, 8):
        m.observe("b", n, 0.004 * n + 0.001)
    assert m.predict_s("b", 16) == pytest.approx(0.004 * 16 + 0.001)
    assert m.predict_s("b", 0) == pytest.approx(0.001)  # intercept b


def test_latency_model_predicts_none_before_two_distinct_sizes() -> None:
    m = LatencyModel()
    assert m.predict_s("b", 4) is None
    m.observe("b", 4, 0.010)
    m.observe("b", 4, 0.012)
    assert m.predict_s("b", 4) is None
    m.observe("b", 8, 0.020)
    assert m.predict_s("b", 4) is not None


def test_latency_model_fits_each_bucket_separately() -> None:
    m = fitted(5.0)
    assert m.predict_s("other", 4) is None
    m.observe("other", 1, 0.001)
    m.observe("other", 2, 0.002)
    assert m.predict_s("other", 10) == pytest.approx(0.010)
    assert m.predict_s("b", 10) == pytest.approx(0.050)


def test_latency_model_forgets_observations_outside_window() -> None:
    m = LatencyModel(window=2)
    m.observe("b", 1, 1.0)
    m.observe("b", 2, 2.0)
    m.observe("b", 1, 0.5)
    m.observe("b", 2, 1.0)
    assert m.predict_s("b", 4) == pytest.approx(2.0)


def test_max_size_within_is_largest_size_inside_budget() -> None:
    assert fitted(5.0).max_size_within("b", 0.025, 32) == 5
    assert fitted(5.0).max_size_within("b", 0.029, 32) == 5


def test_max_size_within_is_at_least_one() -> None:
    assert fitted(5.0).max_size_within("b", 0.001, 32) == 1


def test_max_size_within_is_at_most_upper() -> None:
    assert fitted(5.0).max_size_within("b", 10.0, 32) == 32


def test_max_size_within_is_upper_before_fit() -> None:
    assert LatencyModel().max_size_within("b", 0.001, 16) == 16


# -- Decision and bookkeeping -----------------------------------------------------------


def test_trigger_values_are_the_enum_with_stable_labels() -> None:
    b = batcher(req("r", RT))
    assert isinstance(b.next_batch(now=0.0).trigger, Trigger)
    assert [t.value for t in Trigger] == [
        "full",
        "delay",
        "realtime",
        "high",
        "memory",
        "deadline",
        "window",
        "preferred",
    ]


def test_batched_requests_are_no_longer_held() -> None:
    b = batcher(*(req(f"r{i}") for i in range(6)), max_batch_size=4)
    assert len(b) == 6
    first = b.next_batch(now=0.0)
    second = b.next_batch(now=2.0)
    assert len(b) == 0
    assert set(ids(first)).isdisjoint(ids(second))
    assert sorted(ids(first) + ids(second)) == [f"r{i}" for i in range(6)]


def test_removed_request_is_no_longer_held_or_batched() -> None:
    b = batcher(req("keep"), req("gone"))
    removed = b.remove("gone")
    assert removed is not None and removed.id == "gone"
    assert len(b) == 1
    assert ids(b.next_batch(now=2.0)) == ["keep"]


def test_removing_unknown_request_returns_none() -> None:
    b = batcher(req("keep"))
    assert b.remove("nope") is None
    assert len(b) == 1


def test_empty_batcher_waits_for_arrival() -> None:
    d = batcher().next_batch(now=0.0)
    assert (d.batch, d.trigger, d.expired, d.wake_at_s) == ([], None, [], None)


# -- REALTIME lane ----------------------------------------------------------------------


def test_realtime_lane_takes_only_realtime_requests() -> None:
    b = batcher(
        req("k1", BULK, at=0.0), req("rt", RT, at=0.5), req("k2", BULK, at=0.1),
        realtime_lane=True,
    )  # fmt: skip
    d = b.next_batch(now=0.5, lane=Lane.REALTIME)
    assert ids(d) == ["rt"] and d.trigger is Trigger.REALTIME
    assert len(b) == 2  # the BULK requests stay for the main lane


def test_main_lane_never_sees_realtime_requests_when_the_lane_is_on() -> None:
    b = batcher(req("rt", RT, at=0.0), req("k", BULK, at=0.0), realtime_lane=True)
    d = b.next_batch(now=0.0, lane=Lane.MAIN)
    assert ids(d) == []  # no REALTIME trigger for the main lane: BULK waits its delay
    d = b.next_batch(now=1.0, lane=Lane.MAIN)
    assert ids(d) == ["k"] and d.trigger is Trigger.DELAY


def test_with_a_realtime_lane_main_batches_are_not_capped() -> None:
    bulk = [req(f"k{i}", BULK, at=0.0) for i in range(20)]
    b = batcher(
        req("rt", RT, at=0.0), *bulk, model=fitted(5.0), realtime_budget_ms=25.0,
        max_batch_size=32, realtime_lane=True,
    )  # fmt: skip
    assert b.size_cap("b", now=0.1) == 32  # without the lane: 5 (25 ms at 5 ms each)
    d = b.next_batch(now=1.0, lane=Lane.MAIN)
    assert len(d.batch) == 20


def test_realtime_lane_is_empty_without_the_option() -> None:
    b = batcher(req("rt", RT, at=0.0))
    assert ids(b.next_batch(now=0.0, lane=Lane.REALTIME)) == []
    assert ids(b.next_batch(now=0.0, lane=Lane.MAIN)) == ["rt"]


def test_lane_of_sends_realtime_to_its_lane_only_when_the_lane_is_on() -> None:
    rt, bulk = req("rt", Priority.REALTIME), req("b", Priority.BULK)
    with_lane = batcher(realtime_lane=True)
    assert with_lane.lane_of(rt) is Lane.REALTIME and with_lane.lane_of(bulk) is Lane.MAIN
    without = batcher()
    assert without.lane_of(rt) is Lane.MAIN and without.lane_of(bulk) is Lane.MAIN


# -- preferred batch sizes (Triton's preferred_batch_size) -----------------------------------
def test_preferred_size_runs_at_once_with_the_largest_that_fills() -> None:
    # 3 held, preferred (1, 4, 8): 1 is the largest that 3 requests fill, and it runs at
    # once although the delay is far from over.
    b = batcher(req("a"), req("b", at=0.001), req("c", at=0.002), preferred_batch_sizes=(1, 4, 8))
    d = b.next_batch(now=0.002)
    assert ids(d) == ["a"] and d.trigger is Trigger.PREFERRED
    for i in range(3):
        b.add(req(f"n{i}", at=0.003))
    d = b.next_batch(now=0.003)  # b, c and 3 new: 5 held -> a batch of 4, oldest first
    assert ids(d) == ["b", "c", "n0", "n1"] and d.trigger is Trigger.PREFERRED


def test_no_preferred_size_fillable_waits_then_sends_all() -> None:
    # preferred (8, 16): 5 requests fill none, so they wait for the delay (Triton: the
    # largest batch possible, after max_queue_delay), then all 5 go.
    b = batcher(*(req(f"r{i}") for i in range(5)), preferred_batch_sizes=(8, 16),
                max_queue_delay_ms=4.0)  # fmt: skip
    d = b.next_batch(now=0.001)
    assert d.batch == [] and d.wake_at_s == pytest.approx(0.004)
    d = b.next_batch(now=0.004)
    assert len(d.batch) == 5 and d.trigger is Trigger.DELAY


def test_other_triggers_release_the_largest_preferred_size() -> None:
    # 12 held: the batch is 8 (largest preferred <= 12), at once, and 4 stay held
    b = batcher(*(req(f"r{i}", at=i * 1e-4) for i in range(12)), preferred_batch_sizes=(8,))
    d = b.next_batch(now=0.002)
    assert ids(d) == [f"r{i}" for i in range(8)] and d.trigger is Trigger.PREFERRED
    assert len(b) == 4
    # a REALTIME arrival flushes now: the REALTIME head and 7 more (8 is preferred)
    for i in range(5):
        b.add(req(f"x{i}", at=0.003))
    b.add(req("rt", RT, at=0.003))
    d = b.next_batch(now=0.003)
    assert d.trigger is Trigger.REALTIME and len(d.batch) == 8 and ids(d)[0] == "rt"


def test_without_preferred_sizes_nothing_changes() -> None:
    b = batcher(*(req(f"r{i}") for i in range(5)))
    assert b.next_batch(now=0.0).batch == []  # QUIET: no trigger, no preferred size


def test_a_full_bucket_gives_the_batch_the_members_nearest_the_heads_length() -> None:
    """More held than a batch: after priority, members nearest in length to the head go
    first (less padding); the farthest wait, and one of them is the next head."""
    held = [Pending(id="head", priority=BULK, arrival_s=0.0, deadline_s=None, bucket="len24",
                    length=20)]  # fmt: skip
    # 6 arrivals alternate far (24 tokens) and near (21, 20, 22 tokens) lengths
    for i in range(6):
        length = 24 if i % 2 == 0 else 20 + i % 3
        held.append(Pending(id=f"r{i}", priority=BULK, arrival_s=0.1 + i, deadline_s=None,
                            bucket="len24", length=length))  # fmt: skip
    b = batcher(*held, max_batch_size=4)
    d = b.next_batch(now=10.0)
    assert d.trigger is Trigger.FULL
    # in arrival order it would be head, r0, r1, r2: padded to 24 tokens, not 22
    assert [p.id for p in d.batch] == ["head", "r3", "r1", "r5"]
    assert [p.length for p in d.batch] == [20, 20, 21, 22]
    left = b.next_batch(now=100.0)  # the far ones form the next batch, oldest first
    assert [p.id for p in left.batch] == ["r0", "r2", "r4"]


def test_priority_comes_before_length_when_taking_members() -> None:
    """A HIGH request far from the head's length still goes before a nearer BULK one."""
    head = Pending(id="h", priority=HIGH, arrival_s=0.0, deadline_s=None, bucket="b", length=10)
    far_high = Pending(id="fh", priority=HIGH, arrival_s=2.0, deadline_s=None, bucket="b",
                       length=16)  # fmt: skip
    near_bulk = Pending(id="nb", priority=BULK, arrival_s=1.0, deadline_s=None, bucket="b",
                        length=10)  # fmt: skip
    b = batcher(head, far_high, near_bulk, max_batch_size=2)
    assert [p.id for p in b.next_batch(now=5.0).batch] == ["h", "fh"]
