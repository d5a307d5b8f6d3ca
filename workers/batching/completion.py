"""Completion: the typed hand-off from the inference threads to the worker's event loop, and
what the loop does with each item (events, the result store, acks, one log line).

Why a hand-off: kombu's channels and Celery's event dispatcher are not thread-safe, so
events and acks happen on the loop thread, as in a stock Celery worker. An inference thread
:meth:`Handoff.post` s items (``workers.batching.work``: Started, Progress, Retry, Done) and wakes
the loop through a self-pipe; the loop :meth:`Handoff.drain` s them in order. Without a loop (at
start-up, in baseline mode, while draining at shutdown) items complete inline on the
posting thread.

Settling a final outcome (:meth:`Completer.complete`): store the result (first-wins,
``workers.batching.results``), then ack the request and its twins (``workers.consumer.lease``), then
send ``task-succeeded``/``task-failed``, observe the metrics and log one line. What Redis refuses
is retried with backoff for ``SETTLE_GIVE_UP_S``; a request still unsettled then is given
back to its queue, so its prefetch slot never stays taken.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from shared import clock
from shared.errors import FleetError, InvalidMessage
from shared.keys import delivery_count_key
from workers.batching.refusals import REFUSALS, reason_of
from workers.batching.results import Outcome, ResultWriter, new_token
from workers.batching.work import (
    Done,
    Observers,
    Posted,
    Progress,
    ProgressThrottle,
    Retry,
    Started,
)

__all__ = ["SETTLE_GIVE_UP_S", "Completer", "CompletionHost", "Handoff", "Loop"]

log = logging.getLogger("fleet.engine")

SETTLE_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)  # then every 2 s: Redis restarts take seconds
SETTLE_GIVE_UP_S = 60.0  # a result or ack still refused then: the request is given back


class Loop:
    """Where completions run: the consumer's event loop (``hub``), or inline on the calling
    thread (no loop attached, or draining at shutdown)."""

    def __init__(self) -> None:
        self.hub: Any = None
        self.inline = False

    @property
    def running(self) -> bool:
        return self.hub is not None and not self.inline


class CompletionHost(Protocol):
    """What a completer needs from its engine (the Celery and kombu side)."""

    def ack(self, reqs: list[Any]) -> int:
        """Ack requests in one round trip; how many shared it (``workers.consumer.lease``).

        Raises:
            Exception: Redis refused; none of them is acked (retried later).
        """

    def task_ready(self, req: Any) -> None:
        """Celery's bookkeeping for a finished request."""

    def forget(self, done: Done) -> None:
        """Drop a finished request from what the engine holds."""

    def give_back_unsettled(self, done: list[Done]) -> None:
        """Return requests that could not be settled to their queues."""


class Completer:
    """Settles what the inference threads posted (loop thread, or inline).

    Args:
        writer: the result writer; ``client`` its Redis client (counter deletes).
        host: acks, Celery's bookkeeping, the engine's holdings.
        loop: where completions run.
        obs: counters, metrics, spans.
        progress: the progress throttle (forgotten when a request ends).
    """

    def __init__(
        self,
        writer: ResultWriter,
        client: Any,
        host: CompletionHost,
        loop: Loop,
        obs: Observers,
        progress: ProgressThrottle,
    ) -> None:
        self.writer, self.client, self.host, self.loop = writer, client, host, loop
        self.stats, self.metrics, self.tracing = obs.stats, obs.metrics, obs.tracing
        self.progress = progress

    def handle(self, items: Sequence[Posted]) -> None:
        """Handle posted items in order (finals are settled together, between the others)."""
        finished: list[Done] = []
        for item in items:
            if isinstance(item, Done):
                finished.append(item)
                continue
            if finished:  # keep event order: earlier completions first
                self.complete(finished)
                finished = []
            if isinstance(item, Progress):
                self._progress(item)
            elif isinstance(item, Retry):
                self.metrics.eco.retried(self.metrics.eco.queue_of(item.work.req))
                item.work.req.send_event("task-retried", exception=repr(item.error), traceback="")
            elif isinstance(item, Started):
                self._started(item)
        self.complete(finished)

    def _progress(self, p: Progress) -> None:
        """PROGRESS in the result backend, and a ``task-progress`` event for Flower.

        Flower's event state keeps only the fields Celery knows; ``result`` is one of them,
        so the progress travels there (as ``"done/total"``).
        """
        req = p.work.req
        try:
            self.writer.write_progress(req.id, {"done": p.done, "total": p.total})
        except Exception:
            log.warning("could not store progress of %s", req.id, exc_info=True)
        req.send_event("task-progress", result=f"{p.done}/{p.total}", done=p.done, total=p.total)

    def _started(self, s: Started) -> None:
        for w in s.batch:
            if w.attempts == 0:
                w.req.on_accepted(os.getpid(), time.monotonic())

    def store(self, done: list[Done]) -> bool:
        """Write the final results of ``done`` (first-wins); duplicates write nothing."""
        todo = [d for d in done if not d.duplicate]
        for d in done:
            if d.duplicate:
                d.stored = True
        if not todo:  # copies counted at arrival: their counters go (best effort)
            with contextlib.suppress(Exception):
                self.client.delete(*[delivery_count_key(d.req.id) for d in done])
            return True
        fresh = new_token()  # one per write: a token only has to differ from other copies'
        for d in todo:
            d.token = d.token or fresh
        try:
            with self.tracing.result_write([d.req for d in todo]):
                written = self.writer.write(
                    [d.outcome for d in todo],
                    also_delete=[delivery_count_key(d.req.id) for d in todo],
                    tokens=[d.token for d in todo],
                )
        except Exception as exc:
            # Not acked, still leased: retried with backoff (_settle_later).
            self._failed("storing %d results", len(todo), exc)
            for d in todo:
                d.stored = False
            return False
        REFUSALS.accepted("results")
        for d, ok in zip(todo, written, strict=True):
            d.stored = True
            if not ok:  # an earlier final result stands: this copy only needs its ack
                d.duplicate = True
                self.stats.duplicates += 1
        return True

    def complete(self, done: list[Done]) -> None:
        """Store, ack and finish ``done``; what Redis refuses is retried later."""
        unstored = [d for d in done if not d.stored]
        if unstored:
            self.store(unstored)
        stored = [d for d in done if d.stored and not d.acked]
        if stored:
            reqs = [r for d in stored for r in (d.req, *(d.work.twins if d.work else ()))]
            try:
                self.stats.acked_in_batches += self.host.ack(reqs)
                for d in stored:
                    d.acked = True
            except Exception as exc:  # stored, not acked: still leased, retried
                self._failed("acking %d requests", len(reqs), exc)
        now = time.monotonic()
        left = []
        for d in done:
            if d.acked:
                self._finish_one(d, now)
            else:
                left.append(d)
        if left:
            self._settle_later(left, now)

    @staticmethod
    def _failed(what: str, n: int, exc: Exception) -> None:
        """Log a store or ack Redis refused; a refusal of writes is reported once, by
        ``workers.batching.refusals``, not at every retry."""
        reason = reason_of(exc)
        if reason is None:
            log.warning(f"{what} failed (%s); will retry", n, exc)
        else:
            REFUSALS.refused("results", reason, exc)

    def _settle_later(self, done: list[Done], now: float) -> None:
        """Retry storing/acking ``done`` with backoff; give them back after
        ``SETTLE_GIVE_UP_S`` (their prefetch slots must not stay taken for good), unless
        Redis refuses writes: giving back is a write too, and would only drop their
        leases (they would run again elsewhere once writes resume); they wait under lease."""
        for d in done:
            d.first_failure_s = d.first_failure_s or now
            d.attempts += 1
        self.stats.settle_retries += len(done)
        oldest = min(d.first_failure_s for d in done)
        if now - oldest >= SETTLE_GIVE_UP_S and not REFUSALS.refusing():
            log.error("%d requests could not be settled for %.0f s; giving them back",
                      len(done), SETTLE_GIVE_UP_S)  # fmt: skip
            self.host.give_back_unsettled(done)
            return
        delay = SETTLE_BACKOFF_S[min(done[0].attempts - 1, len(SETTLE_BACKOFF_S) - 1)]
        if self.loop.running:
            self.loop.hub.call_later(delay, self.complete, done)
        else:  # no event loop (draining, tests): this thread waits
            time.sleep(delay)
            self.complete(done)

    def _finish_one(self, d: Done, now: float) -> None:
        req, o, w = d.req, d.outcome, d.work
        self.host.forget(d)
        for twin in w.twins if w else ():
            self.host.task_ready(twin)
        if d.duplicate:
            self.host.task_ready(req)
            log.info("request id=%s state=DUPLICATE (a final result stood; acked)", req.id)
            return
        if o.error is None:
            self.stats.succeeded += 1
            summary = (
                {
                    "batch_id": w.batch_id,
                    "batch_size": w.batch_size,
                    "queued_ms": round((w.started_s - w.arrival_s) * 1000.0, 2),
                    "run_ms": round(d.run_ms, 2),
                }
                if w
                else {}
            )
            req.send_event("task-succeeded", result=repr(summary), runtime=d.run_ms / 1000.0)
        else:
            self.stats.failed += 1
            self.stats.errors[o.error.code] += 1
            req.send_event("task-failed", exception=repr(o.error), traceback="")
        self.host.task_ready(req)
        self.tracing.finished(req, o.error.code if o.error else None)
        self.progress.forget(req.id)
        self._observe(d, now)

    def _observe(self, d: Done, now: float) -> None:
        """The request's metrics and its one log line."""
        req, o, w = d.req, d.outcome, d.work
        ran = w is not None and bool(w.started_s)
        queued_ms = (w.started_s - w.arrival_s) * 1000.0 if w and ran else 0.0
        self.metrics.observe_request(
            w.env.priority if w else d.priority,
            "ok" if o.error is None else o.error.code,
            queued_ms / 1000.0 if ran else None,
            (clock.now_s() - w.env.submitted_ms / 1000.0) if w else None,
            self.metrics.eco.queue_of(req),
            d.run_ms / 1000.0 if ran else None,
        )
        log.info(
            "request id=%s state=%s code=%s priority=%s queued_ms=%.1f run_ms=%.1f "
            "batch=%s size=%d bucket=%s length=%d attempts=%d total_ms=%.1f since_submit_ms=%.1f",
            req.id,
            o.state,
            o.error.code if o.error else "-",
            w.env.priority if w else "-",
            queued_ms,
            d.run_ms,
            w.batch_id if w else "-",
            w.batch_size if w else 0,
            w.prepared.bucket if w else "-",
            w.prepared.length if w else 0,
            (w.attempts + 1) if w else 0,
            (now - w.arrival_s) * 1000.0 if w else 0.0,
            # both on Redis' clock (shared.clock): meaningful across hosts
            (clock.now_s() * 1000.0 - w.env.submitted_ms) if w else 0.0,
        )

    def refuse_message(self, message: Any, exc: Exception) -> None:
        """A message no request could be built from: a coded ``INVALID_MESSAGE`` result
        under its task id (when it has one), then acked. Never raises: the consumer must
        not die on a message (it would die again on its redelivery, forever)."""
        headers = getattr(message, "headers", None)
        task_id = headers.get("id") if isinstance(headers, dict) else None
        err = (
            exc
            if isinstance(exc, InvalidMessage)
            else InvalidMessage(f"malformed message: {type(exc).__name__}: {exc}")
        )
        log.warning("malformed message id=%s: %s", task_id, err.message)
        try:
            if isinstance(task_id, str) and task_id:
                self.writer.write([Outcome(task_id, error=err)])
            message.ack()
        except Exception:  # Redis away: leave it leased; its redelivery is refused again
            log.warning("could not settle malformed message id=%s", task_id, exc_info=True)
            return
        self.stats.failed += 1
        self.stats.errors[err.code] += 1

    def refuse(self, req: Any, exc: FleetError, priority: str = "unknown") -> None:
        """Fail a request that was never held with ``exc`` (stored first-wins, then acked)."""
        self.complete([Done(None, req, Outcome(req.id, error=exc), priority=priority)])


class Handoff:
    """Items from the inference threads to the loop thread, in order, through a self-pipe.

    Args:
        completer: settles the items.
        loop: where they are settled.
        store_early: true on a thread whose finals are stored at once, before the loop
            sees them (the REALTIME lane: its clients do not wait for the loop).
    """

    def __init__(self, completer: Completer, loop: Loop, store_early: Callable[[], bool]) -> None:
        self.completer, self.loop, self.store_early = completer, loop, store_early
        self.on_drain: Callable[[], None] = lambda: None  # after each drain (loop thread)
        self._items: deque[Posted] = deque()
        self._counts = threading.Condition()
        self._posted = self._handled = 0  # items handed over / handled by the loop thread
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def attach(self, hub: Any) -> None:
        """Drain on ``hub`` (the consumer's event loop) whenever items were posted."""
        self.loop.hub = hub
        hub.add_reader(self._wake_r, self.drain)

    def post(self, items: Sequence[Posted]) -> None:
        """Hand ``items`` to the loop thread (any thread); inline without a loop."""
        if not items:
            return
        if self.loop.inline:
            self.completer.handle(items)
            return
        done = [i for i in items if isinstance(i, Done)]
        if done and self.store_early():
            # Events and acks still follow on the loop thread (kombu's channels are not
            # thread-safe); the ack still comes after the result.
            self.completer.store(done)
        with self._counts:
            self._posted += len(items)
            self._items.extend(items)
        self.wake()

    def wait_handled(self, timeout_s: float) -> bool:
        """Wait until the loop thread handled every item posted before this call (results
        stored, or their retry scheduled); ``False`` if ``timeout_s`` passed first (any
        thread but the loop's). A suspect runs only after this (``workers.batching.execution``):
        a batch that ended, but whose results were not yet stored, would be blamed for a
        death the suspect causes."""
        with self._counts:
            target = self._posted
            return self._counts.wait_for(lambda: self._handled >= target, timeout_s)

    def wake(self) -> None:
        """Have the loop thread drain (and call ``on_drain``) soon (any thread)."""
        with contextlib.suppress(BlockingIOError):  # pipe full: a wake-up is pending anyway
            os.write(self._wake_w, b"x")

    def drain(self) -> None:
        """Handle everything posted so far (loop thread)."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass
        items: list[Posted] = []
        while self._items:
            items.append(self._items.popleft())
        try:
            self.completer.handle(items)
        finally:
            with self._counts:
                self._handled += len(items)
                self._counts.notify_all()
        self.on_drain()
