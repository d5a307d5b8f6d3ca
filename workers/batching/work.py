"""What the engine's parts hand each other: a held request, its outcome, the hand-off items.

No Celery here: ``req`` is whatever the front door received (a
``celery.worker.request.Request`` in a worker; any object with ``id`` in the unit tests).

Hand-off items (inference thread -> loop thread, in order; see ``workers.batching.completion``):

- :class:`Started`: a batch is about to run (``task-started`` for first attempts);
- :class:`Progress`: a long request reported progress;
- :class:`Retry`: a transient fault, the request runs again after ``countdown_s``;
- :class:`Done`: a final outcome, to store, ack and log.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from shared import clock
from shared.errors import FleetError
from shared.metrics import FleetMetrics
from shared.schema import Priority, TaskEnvelope
from shared.tracing import Tracing
from workers.batching.batcher import Pending
from workers.batching.results import Outcome
from workers.models.base import Prepared

__all__ = [
    "Done",
    "EngineStats",
    "Observers",
    "Posted",
    "Progress",
    "ProgressThrottle",
    "Retry",
    "Started",
    "Work",
    "monotonic_deadline",
]

PROGRESS_INTERVAL_S = 0.25  # at most this often per request: progress is for humans


@dataclass(slots=True)
class Work:
    """A request held by the engine: the received request plus what the engine derived.

    Attributes:
        arrival_s: when it entered the prefetch window (monotonic seconds).
        fault: an injected fault spec (``workers.batching.inject``), or ``None``.
        attempts: in-place retries so far (0 on the first run).
        started_s: when its (last) batch started (monotonic seconds; 0.0 before).
        counted: its in-flight counter was incremented for this delivery
        (``workers.batching.execution``).
        suspect: an earlier delivery's worker died with it: it runs alone
        (``workers.batching.execution``).
        twins: more copies of this task id, held: acked (or given back) with it.
    """

    req: Any
    env: TaskEnvelope
    prepared: Prepared
    arrival_s: float
    fault: str | None = None
    attempts: int = 0
    started_s: float = 0.0
    batch_id: str = ""
    batch_size: int = 0
    counted: bool = False
    suspect: bool = False
    twins: list[Any] = field(default_factory=list)

    def pending(self, arrival_s: float, bucket: str | None = None) -> Pending:
        """This request as the batcher sees it, arriving at ``arrival_s`` (monotonic s);
        ``bucket`` overrides the prepared bucket (a suspect runs in a bucket of its own)."""
        return Pending(
            id=self.req.id,
            priority=Priority.parse(self.env.priority),
            arrival_s=arrival_s,
            deadline_s=monotonic_deadline(self.env.deadline_ms),
            bucket=self.prepared.bucket if bucket is None else bucket,
            length=self.prepared.length,
            nbytes=self.prepared.nbytes,
            item=self,
        )


@dataclass(slots=True)
class Started:
    batch: list[Work]


@dataclass(slots=True)
class Progress:
    work: Work
    done: int
    total: int


@dataclass(slots=True)
class Retry:
    work: Work
    error: FleetError
    countdown_s: float


@dataclass(slots=True)
class Done:
    """A final outcome on its way to the result store, and how far settling it got.

    Attributes:
        work: ``None`` for a request refused before it was held.
        priority: the metric label of a request refused before it was held.
        stored: ``None`` not yet written; ``False`` the write failed (retried).
        duplicate: the request had its final result already: ack it, write nothing.
        first_failure_s: monotonic time of the first refused store or ack.
        attempts: store/ack attempts so far.
        token: its final write's token (``workers.batching.results.new_token``), drawn at the first
            store attempt (one for all the requests of that write) and kept for the
            retries: a retry after a lost reply finds its own write (stored) rather than a
            duplicate's.
    """

    work: Work | None
    req: Any
    outcome: Outcome
    run_ms: float = 0.0
    priority: str = "unknown"
    stored: bool | None = None
    duplicate: bool = False
    acked: bool = False
    first_failure_s: float = 0.0
    attempts: int = 0
    token: str = ""


Posted = Done | Progress | Retry | Started


@dataclass(slots=True)
class EngineStats:
    """The engine's counters (``fleet_stats``); ``model_s`` in seconds, all lanes."""

    received: int = 0
    succeeded: int = 0
    failed: int = 0
    expired: int = 0
    retried: int = 0
    acked_in_batches: int = 0  # acks that shared a Redis pipeline (workers.consumer.lease)
    duplicates: int = 0  # copies acked without running or writing: a final result stood
    twins: int = 0  # copies of a task id the window held already
    revoked: int = 0
    settle_retries: int = 0  # result writes or acks retried after Redis refused them
    given_back: int = 0  # messages returned to their queue unrun (shutdown, unsettled)
    model_s: float = 0.0
    batches: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)
    triggers: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True, slots=True)
class Observers:
    """Where the parts report: the engine's counters, its metrics and its spans."""

    stats: EngineStats
    metrics: FleetMetrics
    tracing: Tracing


class ProgressThrottle:
    """At most one progress report per request every ``interval_s`` (the last one always).

    Written by an inference thread, forgotten on the loop thread; single dict operations
    are atomic under the GIL.
    """

    def __init__(self, interval_s: float = PROGRESS_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._at: dict[str, float] = {}

    def due(self, task_id: str, done: int, total: int, now: float) -> bool:
        if done < total and now - self._at.get(task_id, 0.0) < self.interval_s:
            return False
        self._at[task_id] = now
        return True

    def forget(self, task_id: str) -> None:
        self._at.pop(task_id, None)


def monotonic_deadline(deadline_ms: float | None) -> float | None:
    """A deadline (epoch ms on Redis' clock, ``shared.clock``) on this process's monotonic
    clock."""
    if deadline_ms is None:
        return None
    return time.monotonic() + (deadline_ms - clock.now_s() * 1000.0) / 1000.0
