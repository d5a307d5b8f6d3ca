"""Execution: run one batch on an inference thread and decide every member's outcome.

:meth:`BatchRunner.run` reads, in order:

1. the circuit breaker (:class:`CircuitBreaker`): while it is open
   the batch fails fast with ``CIRCUIT_OPEN`` and the model is not called;
2. the gate (the engine's: revoked members, members with a final result already, the lane's
   blame record); a :class:`~workers.batching.completion.Started` item for the rest;
3. ``preprocess`` per member: a member whose preprocess raises fails alone (a
   :class:`~shared.errors.FleetError` keeps its code; anything else is ``INVALID_INPUT``);
4. ``run_batch`` with bisection: a batch that raises is split in halves until the member
   that causes the fault fails alone; its batch-mates succeed. An out-of-memory batch is
   thereby split and rerun in halves; a member that still does not fit alone fails
   ``DEVICE_OOM``;
5. latency observation (the batcher's model, only from batches where every member
   succeeded) and the breaker's verdict: a batch where nothing succeeded and every error is
   a model or device fault counts as a failure; bad input never does;
6. retry decisions (:class:`RetryPolicy`): a retryable error (``TransientError``) within the
   modality's ``max_retries`` is scheduled to run again after ``retry_backoff_s * 2**attempt``
   (a :class:`~workers.batching.completion.Retry` item); every other outcome is final
   (:class:`~workers.batching.completion.Done`).

Everything leaves through ``post`` (the hand-off to the loop thread,
``workers.batching.completion``) and retries through ``schedule`` (the engine's delay queue).
No Celery here; Redis only through the gate's blame records
(:class:`~workers.batching.admission.InFlight`).

A batch with a *suspect* (a delivery whose worker died before) runs alone
(:class:`~workers.batching.admission.Isolation`), after the outcomes posted before it are stored
(``settled``), and its own are stored before the next batch starts.

The circuit breaker (:class:`CircuitBreaker`) stops feeding a model that keeps failing.

States (pure logic; every call takes ``now`` in monotonic seconds):

- CLOSED: batches run. ``threshold`` consecutive failed batches (every request of the batch
  that reached the model failed with a model or device fault) open it.
- OPEN: requests fail fast with ``CIRCUIT_OPEN`` for ``cooldown_s``.
- HALF_OPEN: after the cool-down one probe batch runs; success closes the breaker, failure
  opens it again for another cool-down.

Bad input never counts: an input error is the caller's fault, not the model's.
:func:`judge_breaker` gives the breaker a batch's verdict; the runner
(:class:`BatchRunner`) asks :meth:`CircuitBreaker.allow` before each
batch and calls :func:`judge_breaker` after it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from shared.errors import (
    CircuitOpen,
    DeviceError,
    DeviceOOM,
    FleetError,
    InvalidInput,
    ModelError,
)
from workers.batching import heap
from workers.batching.admission import Isolation
from workers.batching.batcher import LatencyModel, Pending, Trigger, Work
from workers.batching.completion import (
    Done,
    Observers,
    Outcome,
    Posted,
    Progress,
    ProgressThrottle,
    Retry,
    Started,
)
from workers.batching.inject import RequestInjector
from workers.models.base import ModelAdapter
from workers.models.runtime import DeviceRuntime

__all__ = [
    "BatchRunner",
    "CircuitBreaker",
    "RetryPolicy",
    "RunnerHost",
    "State",
    "as_fleet_error",
    "judge_breaker",
]


log = logging.getLogger("fleet.engine")


# give glibc's freed-but-kept heap pages back (see workers.batching.heap.trim)
TRIM_EVERY_BATCHES = 10


SETTLE_WAIT_S = 10.0  # longest a suspect waits for earlier outcomes to be stored


def as_fleet_error(exc: BaseException) -> FleetError:
    """The coded error of a batch fault: a FleetError as is, an out-of-memory error as
    ``DEVICE_OOM`` (matched by message or type: torch's differ by backend), else
    ``MODEL_ERROR``."""
    if isinstance(exc, FleetError):
        return exc
    if "out of memory" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError":
        return DeviceOOM(f"request does not fit in the worker's memory partition: {exc}")
    return ModelError(f"{type(exc).__name__}: {exc}")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """In-place retries of transient faults: at most ``max_retries``, after
    ``backoff_s * 2**attempt`` seconds."""

    max_retries: int
    backoff_s: float

    def countdown_s(self, error: FleetError | None, attempts: int) -> float | None:
        """Seconds before the next attempt of a request that ran ``attempts + 1`` times and
        ended with ``error``; ``None`` when that outcome is final."""
        if error is None or not error.retryable or attempts >= self.max_retries:
            return None
        return self.backoff_s * (2**attempts)


class RunnerHost(Protocol):
    """What a runner needs from its engine (any thread may call these)."""

    def post(self, items: Sequence[Posted]) -> None:
        """Hand ``items`` to the loop thread, in order."""

    def schedule(self, pending: Pending) -> None:
        """Hold a retry until ``pending.arrival_s`` (monotonic seconds)."""

    def gate(self, batch: list[Work]) -> list[Work]:
        """The members of ``batch`` that may run (it settles the others itself)."""

    def new_batch_id(self) -> str:
        """A batch id unique in the fleet."""


class BatchRunner:
    """Runs batches for one engine (every lane thread shares it).

    Args:
        modality: the worker's modality (for messages).
        adapter, runtime: the model and its device.
        host: posts, schedules, gates and names batches (lanes share the runner).
        obs: counters, metrics, spans.
        breaker: the model's circuit breaker.
        retry: the modality's retry policy.
        latency: the batcher's latency model (observed after clean batches).
        isolation: runs a suspect batch alone (shared with the engine's admission).
        settled: waits (up to the seconds given) until the loop thread handled every
            outcome posted so far (``completion.Handoff.wait_handled``); ``False`` on timeout.
        clock: monotonic seconds (injected by tests).
    """

    def __init__(
        self,
        modality: str,
        adapter: ModelAdapter,
        runtime: DeviceRuntime,
        host: RunnerHost,
        obs: Observers,
        *,
        breaker: CircuitBreaker,
        retry: RetryPolicy,
        latency: LatencyModel,
        faults: RequestInjector,
        progress: ProgressThrottle | None = None,
        isolation: Isolation | None = None,
        settled: Callable[[float], bool] = lambda timeout_s: True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.modality, self.adapter, self.runtime = modality, adapter, runtime
        self.host, self.post = host, host.post
        self.stats, self.metrics, self.tracing = obs.stats, obs.metrics, obs.tracing
        self.breaker, self.retry, self.latency = breaker, retry, latency
        self.faults = faults
        self.progress = progress or ProgressThrottle()
        self.isolation = isolation or Isolation()
        self.settled = settled
        self.clock = clock
        self._trim_count = itertools.count(1)

    def run(self, batch: list[Work], trigger: Trigger | None) -> None:
        """Run ``batch`` (released by ``trigger``) and post every member's outcome."""
        with self.tracing.batch([w.req for w in batch]):
            self._run(batch, trigger)

    def _run(self, batch: list[Work], trigger: Trigger | None) -> None:
        now = self._label(batch, trigger)
        if not self.breaker.allow(now):
            err = CircuitOpen(f"the {self.modality} model's circuit breaker is open")
            self.post([Done(w, w.req, Outcome(w.req.id, error=err)) for w in batch])
            return
        self.runtime.yield_now()
        # A suspect runs alone: a death now is blamed on it only
        # (workers.batching.admission.Isolation).
        # Alone also means after the batches before it are settled (their results stored,
        # their messages acked), and before the next one starts, its own results stored.
        suspect = any(w.suspect for w in batch)
        with self.isolation.running(suspect):
            if suspect:
                self._await_settled("before a suspect batch")
            batch = self.host.gate(batch)
            if not batch:
                return
            self.post([Started(batch)])
            self.metrics.eco.started([self.metrics.eco.queue_of(w.req) for w in batch])
            failed, ready = self._preprocess(batch)
            t0 = time.perf_counter()
            ran = self._run_isolating(ready)
            elapsed = time.perf_counter() - t0
            if suspect:
                self._finish(batch, failed, ran, len(ready), elapsed)
                self._await_settled("after a suspect batch")
                return
        self._finish(batch, failed, ran, len(ready), elapsed)

    def _await_settled(self, when: str) -> None:
        if not self.settled(SETTLE_WAIT_S):  # a stuck loop thread must not stall the lane
            log.warning("outcomes not stored within %.0f s %s", SETTLE_WAIT_S, when)

    def _finish(
        self, batch: list[Work], failed: list[Done], ran: list[Done], n_ran: int, elapsed: float
    ) -> None:
        """Account for a batch whose ``n_ran`` preprocessed members ran in ``elapsed``
        seconds, and post every member's outcome (transient faults scheduled for retry)."""
        self.stats.model_s += elapsed
        if n_ran and all(d.outcome.error is None for d in ran):
            self.latency.observe(batch[0].prepared.bucket, n_ran, elapsed)
        judge_breaker(self.breaker, ran, self.clock())
        for d in ran:
            d.run_ms = elapsed * 1000.0
        if ran:
            self.metrics.observe_batch(len(ran), elapsed, batch[0].env.model)
        self.runtime.yield_now()
        self.post(self._retry_transient(failed + ran))
        if next(self._trim_count) % TRIM_EVERY_BATCHES == 0:
            heap.trim()

    def run_alone(self, inputs: dict[str, Any], model: str | None = None) -> dict[str, Any]:
        """Run one request's inputs alone, in the calling thread (baseline mode).

        Raises:
            FleetError: bad input (with its code) or a model fault (``as_fleet_error``).
        """
        sample = self.adapter.preprocess(self.adapter.prepare_for(model, inputs))
        t0 = time.perf_counter()
        try:
            with self.runtime.batch_context():
                return self.adapter.run_batch([sample])[0]
        except Exception as exc:
            raise as_fleet_error(exc) from None
        finally:
            self.stats.model_s += time.perf_counter() - t0

    def _label(self, batch: list[Work], trigger: Trigger | None) -> float:
        batch_id, now = self.host.new_batch_id(), self.clock()
        for w in batch:
            w.started_s, w.batch_id, w.batch_size = now, batch_id, len(batch)
        self.stats.batches += 1
        self.stats.batch_sizes[len(batch)] += 1
        self.stats.triggers[str(trigger)] += 1
        return now

    def _preprocess(self, batch: list[Work]) -> tuple[list[Done], list[tuple[Work, Any]]]:
        """(members whose preprocess failed, (member, sample) for the others)."""
        failed: list[Done] = []
        ready: list[tuple[Work, Any]] = []
        for w in batch:
            self._sink_to([w])
            try:
                ready.append((w, self.adapter.preprocess(w.prepared)))
            except FleetError as exc:
                failed.append(Done(w, w.req, Outcome(w.req.id, error=exc)))
            except Exception as exc:
                failed.append(Done(w, w.req, Outcome(w.req.id, error=InvalidInput(str(exc)))))
        return failed, ready

    def _run_isolating(self, items: list[tuple[Work, Any]]) -> list[Done]:
        """Run a batch; on a fault, bisect until the failing request fails alone."""
        if not items:
            return []
        self._sink_to([w for w, _ in items])
        try:
            if self.faults.enabled:
                self.faults.before_batch([(w.req.id, w.fault) for w, _ in items])
            with self.runtime.batch_context(), self.tracing.span("model.forward", n=len(items)):
                results = self.adapter.run_batch([s for _, s in items])
            return [
                Done(w, w.req, Outcome(w.req.id, result=r))
                for (w, _), r in zip(items, results, strict=True)
            ]
        except Exception as exc:
            if len(items) == 1:
                w = items[0][0]
                return [Done(w, w.req, Outcome(w.req.id, error=as_fleet_error(exc)))]
            log.warning("batch of %d failed (%s); splitting", len(items), exc)
            mid = len(items) // 2
            return self._run_isolating(items[:mid]) + self._run_isolating(items[mid:])

    def _retry_transient(self, done: list[Done]) -> list[Done]:
        """The final outcomes of ``done``; the others are scheduled and posted as retries."""
        final: list[Done] = []
        for d in done:
            err, w = d.outcome.error, d.work
            countdown = None if w is None else self.retry.countdown_s(err, w.attempts)
            if err is None or w is None or countdown is None:
                final.append(d)
                continue
            w.attempts += 1
            self.stats.retried += 1
            self.host.schedule(w.pending(self.clock() + countdown))
            self.post([Retry(w, err, countdown)])
        return final

    def _sink_to(self, works: list[Work]) -> None:
        """Route the adapter's progress reports (by position in ``works``) to the loop (only
        for an adapter that reports progress)."""
        if not self.adapter.reports_progress:
            return

        def sink(index: int, done: int, total: int) -> None:
            w = works[index]
            if self.progress.due(w.req.id, done, total, self.clock()):
                self.post([Progress(w, done, total)])

        self.adapter.progress_sink = sink


class State(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    """Args: ``threshold`` consecutive failed batches to open; ``cooldown_s`` seconds open."""

    threshold: int = 5
    cooldown_s: float = 10.0
    state: State = State.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    opened_count: int = 0

    def allow(self, now: float) -> bool:
        """May a batch run now? Moves OPEN to HALF_OPEN once the cool-down has passed."""
        if self.state is State.OPEN and now - self.opened_at >= self.cooldown_s:
            self.state = State.HALF_OPEN
        return self.state is not State.OPEN

    def record_success(self) -> None:
        self.state = State.CLOSED
        self.failures = 0

    def record_failure(self, now: float) -> None:
        self.failures += 1
        if self.state is State.HALF_OPEN or self.failures >= self.threshold:
            self.state = State.OPEN
            self.opened_at = now
            self.opened_count += 1

    def snapshot(self) -> dict[str, object]:
        return {
            "state": str(self.state),
            "consecutive_failures": self.failures,
            "times_opened": self.opened_count,
        }


def judge_breaker(breaker: CircuitBreaker, ran: Sequence[Done], now: float) -> None:
    """Tell ``breaker`` how the model did on a batch: one success closes it; a batch whose
    every error is a model or device fault counts as a failure; bad input counts not."""
    if not ran:
        return
    if any(d.outcome.error is None for d in ran):
        breaker.record_success()
    elif all(isinstance(d.outcome.error, ModelError | DeviceError) for d in ran):
        breaker.record_failure(now)
        log.warning("model fault; breaker %s", breaker.snapshot())
