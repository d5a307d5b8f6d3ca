"""Pure statistics of the bench: percentiles, spreads, throughput, per-repetition summaries."""

from __future__ import annotations

import math
import random

import pytest

from producer.tools.bench.records import Record
from producer.tools.bench.stats import (
    combine_lag,
    combine_reps,
    drain_rps,
    latency_summary,
    percentile,
    spread,
    summarize_rep,
    throughput_rps,
)


def rec(i: int, **kw: object) -> Record:
    base: dict[str, object] = {
        "id": f"t{i}",
        "rep": 0,
        "phase": "steady",
        "modality": "text",
        "priority": "normal",
        "source": "text",
        "input_index": i,
        "measured": True,
        "timeout_s": 2.0,
        "sched_ms": 1000.0 * i,
    }
    base.update(kw)
    base.setdefault("sent_ms", base["sched_ms"])
    return Record(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("values", "p", "want"),
    [
        ([5.0], 50, 5.0),
        ([5.0], 99, 5.0),
        ([1.0, 2.0], 50, 1.5),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 25, 2.0),
        ([10.0, 0.0, 5.0], 50, 5.0),  # unsorted input
    ],
)
def test_percentile_linear_between_closest_ranks(
    values: list[float], p: float, want: float
) -> None:
    assert percentile(values, p) == pytest.approx(want)


def test_percentile_matches_numpy_linear_on_random_data() -> None:
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    xs = [rng.expovariate(0.1) for _ in range(1001)]
    for p in (50, 90, 95, 99, 99.9):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))


def test_percentile_refuses_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_latency_summary_and_spread() -> None:
    s = latency_summary([float(x) for x in range(1, 101)])
    assert s["n"] == 100 and s["max"] == 100.0
    assert s["p50"] == pytest.approx(50.5)
    assert s["p99"] == pytest.approx(99.01)
    empty = latency_summary([])
    assert empty == {"n": 0, "p50": None, "p95": None, "p99": None, "max": None}
    assert spread([3.0, None, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0}
    assert spread([None]) is None


def test_drain_rate_counts_successes_over_scheduled_to_done_window() -> None:
    rs = [rec(i, sched_ms=100.0 * i, done_ms=100.0 * i + 50, ok=True) for i in range(10)]
    rs.append(rec(10, sched_ms=1000.0, done_ms=1100.0, ok=False, code="INVALID_INPUT"))
    # 10 successes between 0 ms (first scheduled) and 950 ms (last success done).
    assert drain_rps(rs) == pytest.approx(10 / 0.95)
    assert drain_rps(rs[:1]) is None


def test_throughput_is_the_completion_rate_while_load_is_applied() -> None:
    # Load from 0 to 10 s (one send every 100 ms), warmup before 2 s. The worker finishes
    # 5 warmup requests inside the window too: they count, since it spent the window on them.
    every = [
        rec(i, sched_ms=100.0 * i, done_ms=100.0 * i + 500, ok=True, measured=i >= 20)
        for i in range(101)
    ]
    measured = [r for r in every if r.measured]
    # Window 2,000 .. 10,000 ms: done times 2,000..10,000 are i = 15..95 (81 completions).
    assert throughput_rps(measured, every) == pytest.approx(81 / 8.0)
    # Only measured requests, "first send .. last done": what the drain rate says instead.
    assert drain_rps(measured) == pytest.approx(81 / 8.5)
    # Failures do not count.
    for r in every[50:60]:
        r.ok, r.code = False, "INVALID_INPUT"
    assert throughput_rps(measured, every) == pytest.approx(71 / 8.0)


def test_throughput_of_a_burst_is_its_drain_rate() -> None:
    # Everything scheduled at t=0 (window of 0 s): throughput is the drain rate.
    rs = [rec(i, sched_ms=0.0, done_ms=10.0 * (i + 1), ok=True) for i in range(50)]
    assert throughput_rps(rs, rs) == pytest.approx(50 / 0.5)


def test_latency_is_from_scheduled_time_not_send_time() -> None:
    # The generator was 40 ms late; the request's latency still counts those 40 ms.
    r = rec(0, sched_ms=1000.0, sent_ms=1040.0, done_ms=1100.0, ok=True)
    assert r.e2e_ms == 100.0
    assert r.lag_ms == 40.0


def test_deadline_miss_counts_expired_and_late_successes() -> None:
    late_ok = rec(0, done_ms=2500.0, ok=True, timeout_s=2.0, sched_ms=0.0)
    on_time = rec(1, done_ms=1500.0, ok=True, timeout_s=2.0, sched_ms=0.0)
    expired = rec(2, done_ms=100.0, ok=False, code="DEADLINE_EXCEEDED")
    no_deadline = rec(3, done_ms=99999.0, ok=True, timeout_s=None, sched_ms=0.0)
    bad_input = rec(4, done_ms=10.0, ok=False, code="INVALID_INPUT")
    assert [r.missed_deadline for r in (late_ok, on_time, expired, no_deadline, bad_input)] == [
        True,
        False,
        True,
        False,
        False,
    ]


def _rep(offset: float) -> list[Record]:
    rs = []
    for i in range(20):
        prio = "realtime" if i % 2 else "bulk"
        rs.append(
            rec(
                i,
                priority=prio,
                timeout_s=0.2 if prio == "realtime" else None,
                sched_ms=100.0 * i,
                sent_ms=100.0 * i + (30.0 if i == 5 else 0.5),
                done_ms=100.0 * i + offset + i,
                started_ms=100.0 * i + 5,
                compute_ms=10.0,
                batch_size=4,
                ok=True,
            )
        )
    rs.append(rec(20, measured=False, sched_ms=0.0, done_ms=5.0, ok=True))  # warmup
    rs.append(rec(21, sched_ms=500.0, done_ms=None, ok=False, code="NO_RESULT"))
    return rs


def test_summarize_rep_excludes_warmup_and_splits_by_priority() -> None:
    s = summarize_rep(_rep(50.0))["modalities"]["text"]
    assert s["requests"] == 21 and s["ok"] == 20
    assert s["errors"] == {"NO_RESULT": 1}
    assert list(s["latency_ms"]) == ["realtime", "normal", "bulk"]
    rt = s["latency_ms"]["realtime"]
    assert rt["n"] == 10 and rt["max"] == 50.0 + 19
    assert s["queue_wait_ms"]["bulk"]["p50"] == pytest.approx(5.0)
    assert s["compute_ms"]["bulk"]["p50"] == pytest.approx(10.0)
    assert s["overhead_ms"] == pytest.approx(median_of([50.0 + i - 10.0 for i in range(20)]))
    assert s["deadline"]["realtime"] == {"missed": 0, "requests": 10, "timeout_s": 0.2}
    assert s["request_batch_sizes"] == {4: 20}


def median_of(xs: list[float]) -> float:
    return percentile(xs, 50)


def test_combine_reps_takes_medians_and_sums_counts() -> None:
    reps = [summarize_rep(_rep(off)) for off in (50.0, 60.0, 250.0)]
    c = combine_reps(reps)["text"]
    assert c["requests"] == 63 and c["errors"] == {"NO_RESULT": 3}
    p50s = [r["modalities"]["text"]["latency_ms"]["realtime"]["p50"] for r in reps]
    assert c["latency_ms"]["realtime"]["p50"] == pytest.approx(sorted(p50s)[1])
    assert c["latency_ms"]["realtime"]["spread"]["p50"]["min"] == pytest.approx(min(p50s))
    # offset 250 ms > 200 ms realtime deadline: every realtime request of that rep missed.
    assert c["deadline"]["realtime"]["fraction"] == pytest.approx(10 / 30)
    assert c["throughput_spread"]["min"] <= c["throughput_rps"] <= c["throughput_spread"]["max"]
    assert c["request_batch_sizes"] == {"4": 60}
    assert math.isfinite(c["overhead_ms"])


def test_combine_lag_flags_a_poisson_phase_that_fell_behind() -> None:
    on_time = summarize_rep(_rep(50.0))
    assert not combine_lag([on_time], {"steady": "poisson"})["steady"]["behind"]
    late = [
        rec(i, sched_ms=10.0 * i, sent_ms=10.0 * i + 20, done_ms=1.0, ok=True) for i in range(9)
    ]
    behind = summarize_rep(late)
    out = combine_lag([behind], {"steady": "poisson"})["steady"]
    assert out["behind"] and out["late_fraction"] == 1.0
    # A burst is sent as fast as possible: its lag is the time to send it, not "behind".
    assert not combine_lag([behind], {"steady": "burst"})["steady"]["behind"]
