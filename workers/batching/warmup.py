"""Model warmup split in two: what a worker warms before it says ready, and the rest later.

Warming a bucket runs it at batch size 1 and at the largest size it can reach
(``max_batch_size`` bounded by ``max_batch_bytes``), twice each: the first run pays one-time
costs (allocations, TorchScript's profiling runs), the second is timed and seeds the
batcher's latency model (Triton's ``model_warmup`` likewise runs the shapes the model will
see). A text model has a dozen length buckets, most of them rarely reached by short texts,
and warming them all before ready made a fresh worker wait several seconds for shapes it may
never run. So ``[batching] warmup_buckets_before_ready`` buckets (the shortest first) are
warmed before the worker takes traffic, and the others by the main inference thread whenever
it has no batch to run (:class:`WarmQueue`). A bucket a batch needs before it was warmed
simply pays its one-time costs in that batch; the latency model learns it from real batches.

Warming later only pays where a new shape's first run costs more than its next: on CUDA
(allocations, kernel selection per shape), not for a TorchScript model on the CPU, where
after the process's very first run a new shape runs as fast the first time as the second.
There a background step only takes a core (a batch of 32 at the longest bucket for seconds)
from the traffic, REALTIME included. :func:`warming_pays` decides from the steps warmed
before ready: without a first run notably slower than its second, nothing is left for later.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WarmStep:
    """Run ``bucket`` at batch size ``n`` (twice; the second run is observed)."""

    bucket: str | None
    n: int


def warm_plan(
    buckets: Sequence[str | None], largest: Callable[[str | None], int]
) -> list[list[WarmStep]]:
    """Per bucket, in the adapter's order (shortest first), its steps: sizes 1 and ``largest``.

    Args:
        buckets: the adapter's buckets (``[None]`` for an adapter without buckets).
        largest: the largest batch size a bucket can reach (at least 1).
    """
    return [[WarmStep(b, n) for n in sorted({1, max(1, largest(b))})] for b in buckets]


def split_plan(
    plan: list[list[WarmStep]], before_ready: int | None
) -> tuple[list[WarmStep], list[WarmStep]]:
    """``(steps before ready, steps for later)``: the first ``before_ready`` buckets' steps
    first; ``None`` warms everything before ready (the baseline, which has no idle thread)."""
    k = len(plan) if before_ready is None else max(0, before_ready)
    first = [s for steps in plan[:k] for s in steps]
    rest = [s for steps in plan[k:] for s in steps]
    return first, rest


FIRST_RUN_EXCESS = 0.25  # a first run this much slower than the second: warming pays
FIRST_RUN_EXCESS_MIN_S = 0.005  # and at least this much (a few-ms run's jitter is not it)


def warming_pays(
    runs: Sequence[tuple[float, float]],
    excess: float = FIRST_RUN_EXCESS,
    min_excess_s: float = FIRST_RUN_EXCESS_MIN_S,
) -> bool:
    """Whether warming the rest of the plan pays on this device, from the ``(first_s,
    second_s)`` run times (seconds) of the steps warmed before ready, in order.

    The process's very first run is left out (it pays the model's one-time costs, which no
    later shape pays again). True when a later step's first run took longer than its second
    by more than ``excess`` of it and more than ``min_excess_s``, or when no step is left to
    judge by (warm as planned).
    """
    judged = list(runs)[1:]
    if not judged:
        return True
    return any(first - second > max(excess * second, min_excess_s) for first, second in judged)


class WarmQueue:
    """Warm steps left for later, taken one at a time by the idle main inference thread."""

    def __init__(self, steps: Sequence[WarmStep] = ()) -> None:
        self._steps: deque[WarmStep] = deque(steps)
        self._lock = threading.Lock()
        self.done = 0
        self.seconds = 0.0

    def __len__(self) -> int:
        return len(self._steps)

    def run_one(self, run: Callable[[WarmStep], Any]) -> bool:
        """Run the next step with ``run``; ``False`` when none is left."""
        with self._lock:
            if not self._steps:
                return False
            step = self._steps.popleft()
        t0 = time.perf_counter()
        run(step)
        self.done += 1
        self.seconds += time.perf_counter() - t0
        return True
