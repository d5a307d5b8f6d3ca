"""Completion: the typed hand-off from the inference threads to the worker's event loop, what
the loop does with each item (events, the result store, acks, one log line), and the result
writes themselves (:class:`ResultWriter`).

Why a hand-off: kombu's channels and Celery's event dispatcher are not thread-safe, so events and
acks happen on the loop thread, as in a stock Celery worker. An inference thread
:meth:`Handoff.post` s items (:class:`Started`, :class:`Progress`, :class:`Retry`, :class:`Done`)
and wakes the loop through a self-pipe; the loop :meth:`Handoff.drain` s them in order. Without a
loop (at start-up, in baseline mode, while draining at shutdown) items complete inline on the
posting thread.

Settling a final outcome (:meth:`Completer.complete`): store the result (first-wins, below)
and ack the request and its twins (``workers.consumer.lease``) in the same script call, the
acks after the writes (one round trip per settled group; a group with nothing to write, such as
duplicates, is acked on its own), then send ``task-succeeded``/``task-failed``, observe the
metrics and log one line (the lines of requests settled together share one log record: a
record per request cost several times more than the line itself). What Redis refuses is
retried with backoff for ``SETTLE_GIVE_UP_S``; a request still unsettled then is given back to
its queue, so its prefetch slot never stays taken.

Result writes
-------------

:class:`ResultWriter` stores a batch's final results, the first one of each request winning, in
one round trip. Delivery is at-least-once (a lost ack, a lapsed lease, a
duplicate publish), so a request may run twice; what a client observes must be one final result.
A batch's final writes are one call of a small Lua script (``_WRITE_FIRST``): for each request, if
``fleet:final:<id>`` is absent, the result's SETEX, then the marker ``SET fleet:final:<id> <write
token>``, then PUBLISH, atomically. A
later copy's write changes nothing (a SUCCESS is never overwritten by a redelivered copy's
``DEADLINE_EXCEEDED``). The group's acks (kombu's ``ZREM`` + ``HDEL`` of its messages, a
tenant's ``max_queued`` release) follow in the same call, after every write: a refused write
acks nothing, and a retry acks again, removing nothing more. The marker holds the writer's
token (one per outcome, kept across its retries): a write that ran but whose reply was lost
(Redis shut down or the connection dropped after executing it) is recognised as this writer's
own when it is retried, and reported stored, not as a duplicate.

A script is atomic against other clients but not all-or-nothing: Redis keeps the writes a
script made before one of its commands was refused (an ACL rule, a full disk, a replica
turned read-only). So the document is written before the marker: a script refused halfway
leaves at most a document without a marker, which the retry writes again together with its
marker, never a marker without a document (a request that would read ``PENDING`` for the
marker's whole TTL while every copy of it is acked as a duplicate). Celery's own
``backend.store_result`` refuses only to overwrite a SUCCESS, and with a GET before the write
(two round trips, not atomic). A batch of N costs one script call. ``PROGRESS`` states are not
final: a SETEX and its PUBLISH, never over a final result (``_WRITE_PROGRESS``).

The stored document is Celery's result meta, so ``AsyncResult``, Flower and clients in other
languages read it unchanged::

    {"status": "SUCCESS" | "FAILURE", "result": <value or exception dict>,
     "traceback": null, "children": [], "date_done": "<ISO 8601 UTC>", "task_id": "<id>"}

A failure's ``result`` is Celery's JSON exception encoding with the fleet's code added
(``shared.errors.error_to_wire``): ``{"exc_type": "ImageDecodeError", "exc_message":
["<message>", "IMAGE_DECODE"], "exc_module": "shared.errors"}``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol

from shared import clock, schema
from shared.errors import FleetError, InvalidMessage, error_to_wire
from shared.metrics import FleetMetrics, RequestRow
from shared.tracing import Tracing
from workers.batching.batcher import Work
from workers.batching.refusals import REFUSALS, reason_of

if TYPE_CHECKING:
    from shared.redis_client import Waiter

__all__ = ["SETTLE_GIVE_UP_S", "Completer", "CompletionHost", "Handoff", "Loop"]


log = logging.getLogger("fleet.engine")


SETTLE_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)  # then every 2 s: Redis restarts take seconds


SETTLE_GIVE_UP_S = 60.0  # a result or ack still refused then: the request is given back


MAX_ACKS_IN_WRITE = 4000  # more delivery tags than this are acked on their own (Lua's unpack)


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

    def plan_acks(self, reqs: list[Any]) -> Acks:
        """The acks of ``reqs`` prepared, to be sent inside a result write
        (``workers.consumer.lease.plan_acks``); nothing is sent."""

    def task_ready(self, reqs: Sequence[Any]) -> None:
        """Celery's bookkeeping for finished requests (``worker_state.task_ready`` of each,
        in one go)."""

    def accepted(self, reqs: list[Any]) -> None:
        """Celery's bookkeeping for requests that start running, and their
        ``task-started`` events (``Request.on_accepted`` for each, in one go)."""

    def send_events(self, type_: str, items: Sequence[tuple[Any, dict[str, Any]]]) -> None:
        """``req.send_event(type_, **fields)`` for each ``(req, fields)``, in one go."""

    def forget(self, done: Sequence[Done]) -> None:
        """Drop finished requests from what the engine holds."""

    def give_back_unsettled(self, done: list[Done]) -> None:
        """Return requests that could not be settled to their queues."""


class Completer:
    """Settles what the inference threads posted (loop thread, or inline).

    Args:
        writer: the result writer.
        host: acks, Celery's bookkeeping, the engine's holdings.
        loop: where completions run.
        obs: counters, metrics, spans.
        progress: the progress throttle (forgotten when a request ends).
    """

    def __init__(
        self,
        writer: ResultWriter,
        host: CompletionHost,
        loop: Loop,
        obs: Observers,
        progress: ProgressThrottle,
    ) -> None:
        self.writer, self.host, self.loop = writer, host, loop
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
        self.host.accepted([w.req for w in s.batch if w.attempts == 0])

    def store(self, done: list[Done], ack: Sequence[Done] = ()) -> bool:
        """Write the final results of ``done`` (first-wins); duplicates write nothing.

        ``ack``: settled requests (``done``'s among them) acked in the same round trip, after
        the writes (``results_write_first.lua``), when there is something to write; each is
        then marked ``acked``. Returns whether the write went through (``False``: nothing is
        stored or acked; retried)."""
        todo = [d for d in done if not d.duplicate]
        for d in done:
            if d.duplicate:
                d.stored = True
        if not todo:
            return True
        fresh = new_token()  # one per write: a token only has to differ from other copies'
        for d in todo:
            d.token = d.token or fresh
        reqs = [r for d in ack for r in (d.req, *(d.work.twins if d.work else ()))]
        acks = self.host.plan_acks(reqs) if 0 < len(reqs) <= MAX_ACKS_IN_WRITE else None
        try:
            with self.tracing.result_write([d.req for d in todo]):
                written = self.writer.write(
                    [d.outcome for d in todo],
                    tokens=[d.token for d in todo],
                    acks=acks,
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
        if acks is not None:
            try:
                self.stats.acked_in_batches += acks.finish()
            except Exception as exc:  # acked in Redis; the rest is retried (acks again)
                self._failed("acking %d requests", len(reqs), exc)
            else:
                for d in ack:
                    d.acked = True
        return True

    def complete(self, done: list[Done]) -> None:
        """Store, ack and finish ``done``; what Redis refuses is retried later."""
        unstored = [d for d in done if not d.stored]
        if unstored:  # acked with the writes
            self.store(unstored, ack=[d for d in done if not d.acked])
        stored = [d for d in done if d.stored and not d.acked]
        if stored:  # nothing to write (duplicates, or stored before): acked on their own
            reqs = [r for d in stored for r in (d.req, *(d.work.twins if d.work else ()))]
            try:
                self.stats.acked_in_batches += self.host.ack(reqs)
                for d in stored:
                    d.acked = True
            except Exception as exc:  # stored, not acked: still leased, retried
                self._failed("acking %d requests", len(reqs), exc)
        now = time.monotonic()
        left = [d for d in done if not d.acked]
        if len(left) < len(done):
            self._finish([d for d in done if d.acked], now)
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

    def _finish(self, done: list[Done], now: float) -> None:
        """Finish settled requests: Celery's bookkeeping (each request and its twins), their
        events (one ``send_events`` per type, in the order of their first request), their
        metrics (one ``observe_requests``) and their log lines (one record). What is the
        same for every request of the group is looked up once."""
        host, stats, tracing = self.host, self.stats, self.tracing
        host.forget(done)
        ready: list[Any] = []  # Celery's task_ready: twins first, then the request
        events: dict[str, list[tuple[Any, dict[str, Any]]]] = {}
        rows: list[RequestRow] = []
        lines: list[str] = []
        queue_of = self.metrics.eco.queue_of
        since_ms = clock.now_s() * 1000.0  # Redis' clock (shared.clock): across hosts
        for d in done:
            req, o, w = d.req, d.outcome, d.work
            if w is not None and w.twins:
                ready += w.twins
            ready.append(req)
            if d.duplicate:
                lines.append(f"request id={req.id} state=DUPLICATE (a final result stood; acked)")
                continue
            err = o.error
            if err is None:
                stats.succeeded += 1
                fields = {"result": repr(event_summary(d)), "runtime": d.run_ms / 1000.0}
                events.setdefault("task-succeeded", []).append((req, fields))
            else:
                stats.failed += 1
                stats.errors[err.code] += 1
                fields = {"exception": repr(err), "traceback": "", "result": repr(event_summary(d))}
                events.setdefault("task-failed", []).append((req, fields))
            if tracing.on:
                tracing.finished(req, err.code if err else None)
            lines.append(self._observe(d, now, since_ms, queue_of(req), rows))
        host.task_ready(ready)
        self.progress.forget_all([d.req.id for d in done if not d.duplicate])
        for type_, items in events.items():  # in the order of their first request
            host.send_events(type_, items)
        self.metrics.observe_requests(rows)  # the group's metrics at once
        if lines:  # one log record for the group: a record per request costs ~8x more
            log.info("\n".join(lines))

    @staticmethod
    def _observe(d: Done, now: float, since_ms: float, queue: str, rows: list[RequestRow]) -> str:
        """The request's metrics row (added to ``rows``); its one log line. ``since_ms``:
        now on Redis' clock, the submit time's (ms); ``queue``: its queue label."""
        req, o, w, run_ms = d.req, d.outcome, d.work, d.run_ms
        err = o.error
        if w is None:
            rows.append((d.priority, "ok" if err is None else err.code, None, None, queue, None))
            return (
                f"request id={req.id} state={o.state} code={err.code if err else '-'} "
                f"priority=- tenant=- queued_ms=0.0 run_ms={run_ms:.1f} batch=- size=0 "
                f"bucket=- length=0 attempts=0 total_ms=0.0 since_submit_ms=0.0"
            )
        env, ran = w.env, bool(w.started_s)
        queued_ms = (w.started_s - w.arrival_s) * 1000.0 if ran else 0.0
        since_submit_ms = since_ms - env.submitted_ms
        rows.append(
            (
                env.priority,
                "ok" if err is None else err.code,
                queued_ms / 1000.0 if ran else None,
                since_submit_ms / 1000.0,
                queue,
                run_ms / 1000.0 if ran else None,
            )
        )
        return (
            f"request id={req.id} state={o.state} code={err.code if err else '-'} "
            f"priority={env.priority} tenant={env.tenant or '-'} queued_ms={queued_ms:.1f} "
            f"run_ms={run_ms:.1f} batch={w.batch_id} size={w.batch_size} "
            f"bucket={w.prepared.bucket} length={w.prepared.length} attempts={w.attempts + 1} "
            f"total_ms={(now - w.arrival_s) * 1000.0:.1f} since_submit_ms={since_submit_ms:.1f}"
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
        thread but the loop's). The runner (``workers.batching.execution``) starts a suspect
        only after this (``workers.batching.admission``): a batch that ended, but whose results
        were not yet stored, would be blamed for a death the suspect causes."""
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


_LUA = resources.files("workers.batching")


# The final write and the progress write (``results_write_first.lua``,
# ``results_write_progress.lua``: their KEYS, ARGV, replies and keys in their headers).
_WRITE_FIRST = _LUA.joinpath("results_write_first.lua").read_text("utf-8")


_WRITE_PROGRESS = _LUA.joinpath("results_write_progress.lua").read_text("utf-8")


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request's final state: ``result`` on success, else ``error``."""

    task_id: str
    result: dict[str, Any] | None = None
    error: FleetError | None = None
    keep_existing: bool = False  # a stored document stands (Celery's REVOKED)

    @property
    def state(self) -> str:
        return "SUCCESS" if self.error is None else "FAILURE"


def new_token() -> str:
    """A final write's token: random, 16 hex digits (never the ``"1"`` a producer's cancel
    writes)."""
    return secrets.token_hex(8)


exception_dict = error_to_wire


"""Celery's JSON encoding of an exception with the fleet's code (``shared.errors``)."""


class Acks(Protocol):
    """Acks sent with a result write (``workers.consumer.lease.AckPlan``)."""

    tags: list[str]
    also: Sequence[tuple[Any, ...]]

    def finish(self, release: bool = True) -> int:
        """The bookkeeping after Redis removed ``tags``; how many were acked with them."""


class HasBackend(Protocol):
    """The worker's Celery app, as the writer sees it: its Redis result backend (``expires``,
    ``serializer``, ``encode``, ``client``, ``get_key_for_task``). Typed structurally, so this
    module imports no Celery."""

    backend: Any


class ResultWriter:
    """Writes :class:`Outcome` lists to Celery's Redis result backend in one pipeline.

    ``waiter`` (Redis behind Sentinel): the pipeline ends with ``WAIT``, so results are on a
    replica before the caller counts their messages acked; acks sent in the same script call
    reach the replicas with the results, as one transaction (a script's writes replicate as
    one ``MULTI``/``EXEC``): a failover cannot keep an ack and lose its result
    (``shared.redis_client.Waiter``). Their ``PUBLISH`` follows
    once ``WAIT`` confirmed them (one more round trip): a write a failover then discards
    (it raises ``ReplicationUncertain``, nothing is acked, the request runs again) was never
    announced, so a subscribed client sees one final result, not two.
    """

    def __init__(self, app: HasBackend, waiter: Waiter | None = None) -> None:
        self.waiter = waiter
        self.backend = app.backend
        self.expires_s = int(self.backend.expires or 0)
        self.failure_expires_s = int(getattr(self.backend, "failure_expires", 0) or self.expires_s)
        self._scripts: tuple[Any, Any] | None = None
        # JSON (the fleet's result_serializer) through shared.schema: the same documents,
        # without a batch's float reprs holding the event loop; another serializer: Celery's.
        self.encode = schema.dumps if self.backend.serializer == "json" else self.backend.encode
        self.duplicates = 0  # final writes refused: the request had its final result already
        self.result_key = self._result_key()

    def _result_key(self) -> Callable[[str], Any]:
        """The backend's ``get_key_for_task``, its prefix read once when the key is the prefix
        and the id (Celery's Redis backend: ``b"celery-task-meta-" + id``): Celery joins
        its parts anew for each key."""
        get = self.backend.get_key_for_task
        prefix = getattr(self.backend, "task_keyprefix", None)
        probe = "0b9d8f3c-probe"
        if isinstance(prefix, bytes) and get(probe) == prefix + probe.encode():

            def key(task_id: str) -> Any:
                if type(task_id) is not str or not task_id:  # Celery's rules (UUID, empty)
                    return get(task_id)
                return prefix + task_id.encode()

            return key
        return get

    def _script(self, i: int) -> Any:
        if self._scripts is None:  # registered on first use: meta() needs no Redis
            client = self.backend.client
            self._scripts = (
                client.register_script(_WRITE_FIRST),
                client.register_script(_WRITE_PROGRESS),
            )
        return self._scripts[i]

    def meta(self, o: Outcome, date_done: str | None = None) -> dict[str, Any]:
        """Celery's result meta of ``o`` (``date_done``: ISO 8601 UTC, default now)."""
        return {
            "status": o.state,
            "result": o.result if o.error is None else exception_dict(o.error),
            "traceback": None,
            "children": [],
            "date_done": date_done or datetime.now(UTC).isoformat(),
            "task_id": o.task_id,
        }

    def write_progress(self, task_id: str, progress: dict[str, Any]) -> None:
        """Store a ``PROGRESS`` state whose ``result`` is ``progress`` (e.g. done/total)."""
        meta = {
            "status": "PROGRESS",
            "result": progress,
            "traceback": None,
            "children": [],
            "date_done": None,
            "task_id": task_id,
        }
        key = self.result_key(task_id)
        self._script(1)(
            keys=[schema.final_key(task_id), key],
            args=[self.encode(meta), self.expires_s or 86400],
        )

    def write(
        self,
        outcomes: Sequence[Outcome],
        tokens: Sequence[str] | None = None,
        acks: Acks | None = None,
    ) -> list[bool]:
        """Store every outcome whose request has no final result yet, in one round trip.

        Args:
            outcomes: the final outcomes.
            tokens: one write token per outcome (:func:`new_token`; outcomes of different
                requests may share one), the same on every retry of that outcome's write: a
                retry after a lost reply then finds its own write and reports it stored.
                ``None``: one fresh token for the call (no retry to recognise).
            acks: acks sent in the same script call, after the writes
                (``workers.consumer.lease.AckPlan``: its ``tags`` and ``also`` commands); the
                caller does their bookkeeping (``finish``) once this returns.

        Returns:
            For each outcome, whether it is stored (``False``: another write's final result
            stands and this one was dropped).

        Raises:
            redis.RedisError: the pipeline failed; nothing may be acked then.
        """
        if not outcomes:
            return []
        import redis  # here, not at import: the engine's Celery-free parts import this module

        from shared.redis_client import execute_waiting

        client = self.backend.client
        publish_later = self.waiter is not None
        if tokens is None:
            tokens = [new_token()] * len(outcomes)
        date_done = datetime.now(UTC).isoformat()  # one write, one time
        stored: list[tuple[str, bytes | str]] = []
        tags = acks.tags if acks is not None else ()
        also = acks.also if acks is not None else ()
        keys: list[Any] = [schema.UNACKED_INDEX_KEY, schema.UNACKED_KEY]
        args: list[Any] = ["0" if publish_later else "1", len(outcomes), len(tags)]
        result_key, encode, meta = self.result_key, self.encode, self.meta
        for o, token in zip(outcomes, tokens, strict=True):
            key = result_key(o.task_id)
            value = encode(meta(o, date_done))
            stored.append((key, value))
            ttl = self.failure_expires_s if o.error is not None else self.expires_s
            keys += [schema.final_key(o.task_id), key]
            args += [value, ttl, "1" if o.keep_existing else "0", token]
        args += tags
        for name, key, *rest in also:  # e.g. ("SREM", <tenant's open set>, *ids)
            keys.append(key)
            args += [name, len(rest), *rest]
        sha = self._script(0).sha
        for attempt in (1, 2):
            # EVALSHA straight into the pipeline: redis-py's Script objects in a pipeline
            # first ask SCRIPT EXISTS, one more round trip for every write.
            with client.pipeline(transaction=False) as pipe:
                pipe.evalsha(sha, len(keys), *keys, *args)
                try:
                    replies = execute_waiting(client, pipe, self.waiter)
                    break
                except redis.exceptions.NoScriptError:
                    # Not loaded on this server (it restarted, failed over, or flushed its
                    # scripts): nothing ran.
                    if attempt == 2:
                        raise
                    client.script_load(_WRITE_FIRST)
        written = [bool(r) for r in replies[0]]
        # A 2 (this token's earlier write, its reply lost) is announced here too when the
        # announcement waits for a replica: the earlier attempt never got that far.
        if publish_later and any(written):
            # The results are stored and replicated: a lost announcement costs only
            # subscribers a wait (Celery's result consumer reads stored results when it
            # subscribes again), never the results: the batch is acked all the same.
            try:
                with client.pipeline(transaction=False) as pipe:
                    for (key, value), w in zip(stored, written, strict=True):
                        if w:
                            pipe.publish(key, value)
                    pipe.execute()
            except redis.RedisError as exc:
                log.warning("announcing %d stored results failed: %s", sum(written), exc)
        self.duplicates += written.count(False)
        return written


PROGRESS_INTERVAL_S = 0.25  # at most this often per request: progress is for humans


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
        work: ``None`` for a request refused before it was held. priority: the metric label of a
        request refused before it was held. stored: ``None`` not yet written; ``False`` the write
        failed (retried). duplicate: the request had its final result already: ack it, write
        nothing. first_failure_s: monotonic time of the first refused store or ack. attempts:
        store/ack attempts so far. token: its final write's token
        (``workers.batching.completion.new_token``), drawn at the first
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


def event_summary(d: Done) -> dict[str, Any]:
    """What a settled request's ``task-succeeded``/``task-failed`` event carries as its
    ``result``: a summary, never the result (Flower's task list shows it as a column,
    ``producer/ops/flower_app.py``; ``fleet bench`` reads ``batch_size`` from it). A failure
    leads with its error code; a request that never ran in a batch (refused before it was
    held, expired while queued) has none of the batch's fields."""
    w = d.work
    head = {"error": d.outcome.error.code} if d.outcome.error is not None else {}
    if w is None or not w.batch_id:
        return head
    return {
        **head,
        "batch_id": w.batch_id,
        "batch_size": w.batch_size,
        "queued_ms": round((w.started_s - w.arrival_s) * 1000.0, 2),
        "run_ms": round(d.run_ms, 2),
    }


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

    def forget_all(self, task_ids: Sequence[str]) -> None:
        at = self._at
        if at:  # empty unless a model reports progress
            for task_id in task_ids:
                at.pop(task_id, None)
