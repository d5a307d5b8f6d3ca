"""What a bench run yields: its options, each service mode's records and facts, the whole
result (``producer/bench/runner.py`` fills them, ``report.py`` turns them into the report)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producer.bench.records import Record
from producer.bench.workload import Workload

__all__ = ["MODES", "BenchError", "BenchOptions", "BenchResult", "ModeResult"]

MODES = ("fleet", "baseline", "limit")


class BenchError(RuntimeError):
    """The bench could not run (a worker did not start, a mode failed)."""


@dataclass
class BenchOptions:
    """What to run. ``repetitions`` 0 means the workload's own."""

    workload: Workload
    modes: tuple[str, ...] = MODES
    repetitions: int = 0
    run_dir: Path | None = None


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
