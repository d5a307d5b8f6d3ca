"""What a bench run yields: its options, each service mode's records and facts, the whole
result (``producer/tools/bench/runner.py`` fills them, ``report.py`` turns them into the report)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producer.tools.bench.records import Record
from producer.tools.bench.workload import Workload

__all__ = ["MODES", "BenchError", "BenchOptions", "BenchResult", "ModeResult", "merge_mode"]

MODES = ("fleet", "baseline", "limit")


class BenchError(RuntimeError):
    """The bench could not run (a worker did not start, a mode failed)."""


@dataclass
class BenchOptions:
    """What to run. ``repetitions`` 0 means the workload's own.

    ``interleave``: with several modes, run repetition k of every mode before repetition
    k + 1 of any (each mode's workers started for its repetition and stopped after it, the
    order rotated by one mode per repetition), so that a machine whose speed drifts during
    the run weighs on every mode alike; ``False``: every repetition of one mode, then the
    next mode (the order before 2026-12-03).
    """

    workload: Workload
    modes: tuple[str, ...] = MODES
    repetitions: int = 0
    run_dir: Path | None = None
    interleave: bool = True


@dataclass
class ModeResult:
    """One service mode (fleet or baseline): records and worker facts per repetition."""

    mode: str
    reps: list[list[Record]] = field(default_factory=list)
    summaries: list[dict[str, Any]] = field(default_factory=list)
    batches: dict[str, Counter[int]] = field(default_factory=dict)  # fleet_stats diffs
    triggers: dict[str, Counter[str]] = field(default_factory=dict)
    # per repetition: the model's share of its wall time (fleet_stats model_s diff / wall)
    model_busy: dict[str, list[float]] = field(default_factory=dict)
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    cold: dict[str, dict[str, Any]] = field(default_factory=dict)
    leftovers: int = 0
    gateway: dict[str, Any] = field(default_factory=dict)  # gateway mode: idle overhead


@dataclass
class BenchResult:
    workload: Workload
    repetitions: int
    started_utc: str
    finished_utc: str = ""
    duration_s: float = 0.0
    run_dir: str = ""
    modes: dict[str, ModeResult] = field(default_factory=dict)
    limit: dict[str, Any] = field(default_factory=dict)
    limit_error: str | None = None
    settings_facts: dict[str, Any] = field(default_factory=dict)
    redis_version: str = ""
    load_avg_start: tuple[float, ...] = ()
    load_avg_end: tuple[float, ...] = ()
    notes: list[str] = field(default_factory=list)
    metrics_cost: dict[str, Any] = field(default_factory=dict)  # bench/metricscost.py
    # interleaved runs: the modes in the order each repetition ran them ([] = sequential)
    order: list[list[str]] = field(default_factory=list)
    # workloads with accounting_idle_s (bench/accounting.py), by mode: "idle" (background
    # rates, one per worker start) and "windows" (one per repetition)
    accounting: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)
    # the redis-limit mode (bench/redislimit.py): per modality, throughput_reps
    redis_limit: dict[str, Any] = field(default_factory=dict)
    redis_limit_error: str | None = None
    # worker processes per modality (fleet, baseline, gateway)
    workers: dict[str, int] = field(default_factory=dict)


def merge_mode(into: ModeResult, one: ModeResult) -> None:
    """Add ``one`` (a later start of the same mode: its repetitions, counts and busy shares)
    to ``into``; worker facts and cold-start figures stay those of the first start."""
    into.reps += one.reps
    into.summaries += one.summaries
    for m, c in one.batches.items():
        into.batches.setdefault(m, Counter()).update(c)
    for m, c in one.triggers.items():
        into.triggers.setdefault(m, Counter()).update(c)
    for m, xs in one.model_busy.items():
        into.model_busy.setdefault(m, []).extend(xs)
    for m, facts in one.workers.items():
        into.workers.setdefault(m, facts)
    for m, cold in one.cold.items():
        into.cold.setdefault(m, cold)  # the first start's: a fresh worker
    into.leftovers += one.leftovers
    if one.gateway and not into.gateway:
        into.gateway = one.gateway
