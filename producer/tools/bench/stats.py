"""Statistics of bench records: pure functions, no I/O.

Per repetition (:func:`summarize_rep`), then across repetitions (:func:`combine_reps`):
a latency percentile across repetitions is the median of the per-repetition values, with the
min/median/max spread beside it; counts (requests, errors, deadline misses, batch sizes) are
summed over repetitions. Only measured requests (outside the warmup) count.

Percentiles use linear interpolation between closest ranks (numpy's default ``"linear"``):
``p`` of ``n`` sorted values sits at rank ``p / 100 * (n - 1)``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from producer.tools.bench.records import Record

PRIORITY_ORDER = ("realtime", "high", "normal", "bulk")
PERCENTILES = (50, 95, 99)
# An open-loop phase fell behind when its typical send was late (p50) or its tail was
# (p99). Isolated late sends are normal: a request due while an image message is encoded
# and pushed waits for it (see docs/decisions.md, "Open-loop lag thresholds").
LAG_BEHIND_P50_MS = 5.0
LAG_BEHIND_P99_MS = 50.0
LAG_LATE_MS = 10.0
MIN_WINDOW_S = 1.0  # a load window shorter than this is a burst: throughput is its drain rate


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) of ``values``, linear between closest ranks.

    Raises:
        ValueError: ``values`` is empty or ``p`` is outside 0..100.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile {p} outside 0..100")
    xs = sorted(values)
    rank = p / 100.0 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def median(values: Sequence[float]) -> float | None:
    """The median, or ``None`` for no values."""
    return percentile(values, 50.0) if values else None


def spread(values: Iterable[float | None]) -> dict[str, float] | None:
    """``{"min", "median", "max"}`` of the non-``None`` values, or ``None`` if there are none."""
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    return {"min": min(xs), "median": percentile(xs, 50.0), "max": max(xs)}


def latency_summary(values: Sequence[float]) -> dict[str, float | int | None]:
    """``{"n", "p50", "p95", "p99", "max"}`` in the values' unit; ``None`` stats when empty."""
    out: dict[str, float | int | None] = {"n": len(values)}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(values, p) if values else None
    out["max"] = max(values) if values else None
    return out


def throughput_rps(
    measured: Sequence[Record], every: Sequence[Record] | None = None
) -> float | None:
    """Successful completions per second while the load was applied (steady state).

    The window runs from the earliest scheduled send of a ``measured`` request to the latest
    scheduled send of ``every`` request of the repetition (warmup ones included), and every
    success completed inside it counts, whoever sent it. At saturation a worker spends the
    start of the window finishing requests sent during warmup; counting only the measured
    requests over "first send .. last completion" would leave that work out and understate
    capacity by up to (requests in flight / rate) seconds: about 20 % for ``text-saturate``
    (384 in flight at ~120/s against a 15 s window). Below saturation the result is about
    the offered rate.

    When the load came at once (the window is under ``MIN_WINDOW_S``: a burst) this is
    :func:`drain_rps` instead. ``None`` with fewer than two successes.
    """
    every = measured if every is None else every
    if not measured:
        return None
    start = min(r.sched_ms for r in measured)
    end = max(r.sched_ms for r in every)
    if (end - start) / 1000.0 < MIN_WINDOW_S:
        return drain_rps(measured)
    done = [r for r in every if r.ok and r.done_ms is not None and start <= r.done_ms <= end]
    if len(done) < 2:
        return None
    return len(done) / ((end - start) / 1000.0)


def drain_rps(records: Sequence[Record]) -> float | None:
    """Successes of ``records`` per second from their earliest scheduled send to their
    latest completion: how fast a backlog drains. ``None`` with fewer than two successes."""
    ok = [r for r in records if r.ok and r.done_ms is not None]
    if len(ok) < 2:
        return None
    start = min(r.sched_ms for r in records)
    end = max(r.done_ms for r in ok if r.done_ms is not None)
    if end <= start:
        return None
    return len(ok) / ((end - start) / 1000.0)


def ordered_priorities(names: Iterable[str]) -> list[str]:
    present = set(names)
    return [p for p in PRIORITY_ORDER if p in present] + sorted(present - set(PRIORITY_ORDER))


def summarize_rep(records: Sequence[Record]) -> dict[str, Any]:
    """One repetition of one mode: per modality and priority, measured requests only."""
    measured = [r for r in records if r.measured]
    mods: dict[str, Any] = {}
    for m in sorted({r.modality for r in measured}):
        rs = [r for r in measured if r.modality == m]
        mods[m] = _modality_rep(rs, [r for r in records if r.modality == m])
    return {"modalities": mods, "lag": lag_by_phase(records)}


def _modality_rep(rs: list[Record], every: list[Record]) -> dict[str, Any]:
    ok = [r for r in rs if r.ok]
    prios = ordered_priorities(r.priority for r in rs)

    def per_prio(values_of: Any) -> dict[str, Any]:
        return {
            p: latency_summary(
                [v for r in ok if r.priority == p and (v := values_of(r)) is not None]
            )
            for p in prios
        }

    overheads = [
        r.e2e_ms - r.compute_ms for r in ok if r.e2e_ms is not None and r.compute_ms is not None
    ]
    return {
        "requests": len(rs),
        "ok": len(ok),
        "errors": dict(Counter(r.code or "UNKNOWN" for r in rs if r.ok is False)),
        "throughput_rps": throughput_rps(rs, every),
        "drain_rps": {p: drain_rps([r for r in rs if r.priority == p]) for p in prios},
        "latency_ms": per_prio(lambda r: r.e2e_ms),
        "latency_all_ms": latency_summary([r.e2e_ms for r in ok if r.e2e_ms is not None]),
        "queue_wait_ms": per_prio(lambda r: r.queue_ms),
        "compute_ms": per_prio(lambda r: r.compute_ms),
        "overhead_ms": median(overheads),
        "deadline": {
            p: {
                "missed": sum(r.missed_deadline for r in rs if r.priority == p),
                "requests": sum(r.priority == p for r in rs),
                "timeout_s": next((r.timeout_s for r in rs if r.priority == p), None),
            }
            for p in prios
        },
        "request_batch_sizes": dict(Counter(r.batch_size for r in ok if r.batch_size)),
        "events_seen": sum(r.compute_ms is not None for r in ok),
    }


def lag_by_phase(records: Sequence[Record]) -> dict[str, dict[str, Any]]:
    """Send lag (actual send start minus scheduled time), per phase, in milliseconds."""
    out: dict[str, dict[str, Any]] = {}
    for phase in sorted({r.phase for r in records}):
        lags = [r.lag_ms for r in records if r.phase == phase]
        out[phase] = {
            "n": len(lags),
            "p50": percentile(lags, 50),
            "p99": percentile(lags, 99),
            "max": max(lags),
            "late": sum(x > LAG_LATE_MS for x in lags),
        }
    return out


def combine_reps(reps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median (and spread) of per-repetition summaries of one mode."""
    modalities = sorted({m for r in reps for m in r["modalities"]})
    return {m: _combine_modality([r["modalities"][m] for r in reps if m in r["modalities"]])
            for m in modalities}  # fmt: skip


def _combine_modality(reps: list[dict[str, Any]]) -> dict[str, Any]:
    prios = ordered_priorities(p for r in reps for p in r["latency_ms"])
    tput = [r["throughput_rps"] for r in reps]
    errors: Counter[str] = Counter()
    batch: Counter[int] = Counter()
    for r in reps:
        errors.update(r["errors"])
        batch.update({int(k): v for k, v in r["request_batch_sizes"].items()})
    deadline = {}
    for p in prios:
        missed = sum(r["deadline"].get(p, {}).get("missed", 0) for r in reps)
        total = sum(r["deadline"].get(p, {}).get("requests", 0) for r in reps)
        timeout = next((r["deadline"][p]["timeout_s"] for r in reps if p in r["deadline"]), None)
        deadline[p] = {
            "missed": missed,
            "requests": total,
            "fraction": (missed / total) if total else 0.0,
            "timeout_s": timeout,
        }
    sp = spread(tput)
    return {
        "requests": sum(r["requests"] for r in reps),
        "ok": sum(r["ok"] for r in reps),
        "errors": dict(errors),
        "throughput_rps": None if sp is None else sp["median"],
        "throughput_spread": sp,
        "throughput_reps": tput,
        "drain_rps": {
            p: (spread([r.get("drain_rps", {}).get(p) for r in reps]) or {}).get("median")
            for p in prios
        },
        "latency_ms": {p: _combine_summary([r["latency_ms"].get(p) for r in reps]) for p in prios},
        "latency_all_ms": _combine_summary([r["latency_all_ms"] for r in reps]),
        "queue_wait_ms": {
            p: _combine_summary([r["queue_wait_ms"].get(p) for r in reps]) for p in prios
        },
        "compute_ms": {p: _combine_summary([r["compute_ms"].get(p) for r in reps]) for p in prios},
        "overhead_ms": (spread([r["overhead_ms"] for r in reps]) or {}).get("median"),
        "deadline": deadline,
        "request_batch_sizes": {str(k): v for k, v in sorted(batch.items())},
        "events_seen": sum(r["events_seen"] for r in reps),
    }


def _combine_summary(items: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Median of each statistic across repetitions; ``spread`` holds min/median/max."""
    items = [i for i in items if i]
    out: dict[str, Any] = {"n": sum(int(i["n"]) for i in items)}
    spreads: dict[str, Any] = {}
    for key in (*(f"p{p}" for p in PERCENTILES), "max"):
        sp = spread(i.get(key) for i in items)
        out[key] = None if sp is None else sp["median"]
        spreads[key] = sp
    out["spread"] = spreads
    return out


def combine_lag(reps: Sequence[dict[str, Any]], arrivals: dict[str, str]) -> dict[str, Any]:
    """Worst send lag per phase across repetitions, and whether an open-loop phase fell behind.

    Args:
        reps: per-repetition summaries (their ``lag``).
        arrivals: phase name -> arrival process (``poisson``, ``burst``, ``closed``).
    """
    phases: dict[str, Any] = {}
    for name in sorted({p for r in reps for p in r["lag"]}):
        rows = [r["lag"][name] for r in reps if name in r["lag"]]
        p99 = max(row["p99"] for row in rows)
        worst = max(row["max"] for row in rows)
        arrival = arrivals.get(name, "")
        p50 = (spread(row["p50"] for row in rows) or {}).get("median") or 0.0
        n = sum(row["n"] for row in rows)
        phases[name] = {
            "arrival": arrival,
            "requests": n,
            "p50_ms": p50,
            "p99_ms": p99,
            "max_ms": worst,
            "late_fraction": sum(row["late"] for row in rows) / n if n else 0.0,
            "behind": arrival == "poisson" and (p50 > LAG_BEHIND_P50_MS or p99 > LAG_BEHIND_P99_MS),
        }
    return phases
