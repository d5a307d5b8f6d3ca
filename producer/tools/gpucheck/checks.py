"""The five checks: each runs its probe in child processes and judges the figures it returns.

A check returns a ``CheckResult`` (``ok``, the figures, a one-line detail); ``run_checks``
runs them in order, prints one PASS/FAIL line each and turns an exception into a failure.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from producer.tools.gpucheck.children import run_in_children
from producer.tools.gpucheck.probes import (
    _child_arena,
    _child_fraction,
    _child_latency,
    _child_overlap,
    _child_stream,
)

__all__ = [
    "CHECKS",
    "CheckResult",
    "check_arena_growth",
    "check_memory_fraction",
    "check_overlap",
    "check_stream_per_process",
    "check_warm_vs_cold",
    "run_checks",
]


@dataclass
class CheckResult:
    name: str
    ok: bool
    figures: dict[str, Any] = field(default_factory=dict)
    detail: str = ""
    seconds: float = 0.0
    skipped: bool = False  # always False here: a device check runs or fails


def check_stream_per_process() -> CheckResult:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    a, b = run_in_children(_child_stream, [(barrier,), (barrier,)])
    figs = {"processes": [a, b]}
    problems = []
    for r in (a, b):
        if r["stream"] in (0, r["default_stream"]):
            problems.append(f"pid {r['pid']} runs on the default stream ({r['stream']:#x})")
        if not r["current_in_batch_is_own"]:
            problems.append(f"pid {r['pid']}: batch_context() does not make its stream current")
        if r["stats_stream"] != r["stream"]:
            problems.append(f"pid {r['pid']}: stats() reports stream {r['stats_stream']}")
        if not r["result_ok"]:
            problems.append(f"pid {r['pid']}: wrong result on its stream")
    if a["pid"] == b["pid"]:
        problems.append("both runtimes ran in one process")
    detail = "; ".join(
        f"pid {r['pid']} stream {r['stream']:#x} (default {r['default_stream']:#x})" for r in (a, b)
    )
    return CheckResult("stream per process", not problems, figs, "; ".join(problems) or detail)


def check_memory_fraction(fraction: float = 0.05, chunk_mb: int = 64) -> CheckResult:
    (r,) = run_in_children(_child_fraction, [(fraction, chunk_mb)])
    problems = []
    if not r["one_shot_raised"]:
        problems.append("one allocation of 1.05 x the fraction did not raise")
    if not r["fill_raised"]:
        problems.append(f"filling reached {r['reached_reserved_mb']:.0f} MiB without raising")
    if r["reached_reserved_mb"] > r["fraction_mb"] + 1:
        problems.append("reserved memory passed the fraction")
    if r["reached_reserved_mb"] < 0.8 * r["fraction_mb"] - r["chunk_mb"]:
        problems.append("raised well before the fraction was used (under 80%)")
    detail = (
        f"reached {r['reached_reserved_mb']:.0f} MiB of {r['fraction_mb']:.0f} MiB "
        f"(fraction {r['fraction']} of {r['total_mb']:.0f} MiB) before OutOfMemoryError"
    )
    return CheckResult("memory fraction enforced", not problems, r, "; ".join(problems) or detail)


def check_arena_growth(batches: int = 1000, sizes: tuple[int, ...] = (1, 8, 16, 32)) -> CheckResult:
    (r,) = run_in_children(_child_arena, [(batches, sizes)])
    problems = []
    if r["reserved_mb_after"] > r["reserved_mb_before"]:
        problems.append(
            f"reserved grew {r['reserved_mb_before']:.1f} -> {r['reserved_mb_after']:.1f} MiB"
        )
    if r["allocated_mb_after"] > r["allocated_mb_before"]:
        problems.append(
            f"allocated grew {r['allocated_mb_before']:.2f} -> {r['allocated_mb_after']:.2f} MiB"
        )
    if r["arena_overflows"]:
        problems.append(f"{r['arena_overflows']} batches overflowed the arena")
    detail = (
        f"{r['batches']} batches: reserved {r['reserved_mb_before']:.1f} -> "
        f"{r['reserved_mb_after']:.1f} MiB, allocated {r['allocated_mb_before']:.2f} -> "
        f"{r['allocated_mb_after']:.2f} MiB, {r['ms_per_batch']:.2f} ms/batch"
        f"{'' if r['staged_through_arena'] else ' (runtime has no stage(): plain copies)'}"
    )
    return CheckResult("no arena growth", not problems, r, "; ".join(problems) or detail)


def check_warm_vs_cold(steady: int = 50) -> CheckResult:
    # One after the other, each in a fresh process, so neither disturbs the other's timing.
    (cold,) = run_in_children(_child_latency, [(False, steady)])
    (warm,) = run_in_children(_child_latency, [(True, steady)])
    steady_ms = statistics.median([cold["steady_median_ms"], warm["steady_median_ms"]])
    figs = {
        "cold_first_ms": cold["first_ms"],
        "warm_first_ms": warm["first_ms"],
        "steady_median_ms": steady_ms,
        "warmup_s": warm["warmup_s"],
        "cold_over_steady": cold["first_ms"] / steady_ms if steady_ms else None,
        "warm_over_steady": warm["first_ms"] / steady_ms if steady_ms else None,
    }
    problems = []
    if not warm["first_ms"] < cold["first_ms"]:
        problems.append("the warm first batch was not faster than the cold one")
    detail = (
        f"first batch cold {cold['first_ms']:.2f} ms, warm {warm['first_ms']:.2f} ms, "
        f"steady median {steady_ms:.3f} ms (warmup took {warm['warmup_s']:.2f} s)"
    )
    return CheckResult(
        "warm vs cold first batch", not problems, figs, "; ".join(problems) or detail
    )


def check_overlap(copy_mb: int = 1024, n: int = 8192, reps: int = 5) -> CheckResult:
    (r,) = run_in_children(_child_overlap, [(copy_mb, n, reps)])
    ok = r["overlap_ratio"] >= 0.3
    detail = (
        f"{r['copy_mb']} MiB H2D {r['copy_ms']:.1f} ms ({r['h2d_gb_s']:.1f} GB/s), "
        f"{r['matmuls']} x matmul {n} bf16 {r['compute_ms']:.1f} ms; sequential "
        f"{r['sequential_ms']:.1f} ms, concurrent {r['concurrent_ms']:.1f} ms; "
        f"overlap ratio {r['overlap_ratio']:.2f}"
    )
    if not ok:
        detail = "copy and compute did not overlap (ratio < 0.3): " + detail
    return CheckResult("compute/copy overlap", ok, r, detail)


CHECKS: tuple[Callable[[], CheckResult], ...] = (
    check_stream_per_process,
    check_memory_fraction,
    check_arena_growth,
    check_warm_vs_cold,
    check_overlap,
)


def run_checks(
    checks: Sequence[Callable[[], CheckResult]] = CHECKS,
    out: Callable[[str], None] = print,
) -> list[CheckResult]:
    results = []
    for check in checks:
        t0 = time.monotonic()
        try:
            res = check()
        except Exception as exc:
            name = check.__name__.removeprefix("check_").replace("_", " ")
            res = CheckResult(name, False, {}, f"{type(exc).__name__}: {exc}")
        res.seconds = time.monotonic() - t0
        out(f"gpu-check: [{'PASS' if res.ok else 'FAIL'}] {res.name}: {res.detail}")
        results.append(res)
    return results
