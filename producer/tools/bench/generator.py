"""The load generator: sends planned requests at their scheduled times, from threads.

- :class:`OpenLoop` walks an open-loop phase's schedule (``poisson``, ``burst``; one thread
  and connection per phase, so a burst being sent does not delay a stream beside it): it
  sleeps until the next scheduled time, then sends every request that is due (at most
  ``max_group`` per round) over its held producer connection. It never waits for results.
  When it is late, it sends at once and the delay shows up as ``lag`` (actual send start
  minus scheduled time), which the report states; latencies still count from the scheduled
  time.
- :class:`ClosedLoop` keeps ``concurrency`` requests in flight; a slot frees when the
  result collector stores its outcome, and the refill is scheduled at that moment.

Messages are built by :meth:`producer.client.FleetClient.envelope` (the product's own
validation and deadline) and sent with ``FleetClient.publish_many`` exactly as
``FleetClient.submit_many`` does (kombu's bytes and ``task-sent`` events, pipelined), minus its
queue-length check, which opens a broker connection per call (about 5 ms here): too slow to
keep a schedule. Every Celery mode (the fleet, plain Celery, celery-batches) is sent this
way, each with its own queue and priority, so the generator costs them the same. A request
the client refuses (for example ``PAYLOAD_TOO_LARGE``) is recorded at once with its code, as
a caller would see it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable

from producer.client import FleetClient
from producer.client.wire import Outgoing, PayloadBuilder
from producer.tools.bench.records import SEND_FAILED, Record, RecordTable, Timebase
from producer.tools.bench.schedule import ClosedPicker, Planned
from producer.tools.bench.sources import InputCatalog
from shared import schema
from shared.errors import FleetError
from shared.schema import Priority

log = logging.getLogger("fleet.bench")


class Sender:
    """Turns planned requests into records and broker messages.

    Args:
        fifo_priority: send every message at this Celery priority (the baseline's FIFO);
            ``None`` sends each at its class's priority (the fleet).
        one_queue: send REALTIME to the modality's queue too, as plain Celery users do
            (the celery-batches peer), instead of the fleet's ``<modality>.realtime``.
    """

    def __init__(
        self,
        client: FleetClient,
        catalog: InputCatalog,
        table: RecordTable,
        timebase: Timebase,
        rep: int,
        fifo_priority: int | None = None,
        one_queue: bool = False,
    ) -> None:
        self.client = client
        self.catalog = catalog
        self.table = table
        self.tb = timebase
        self.rep = rep
        self.fifo_priority = fifo_priority
        self.one_queue = one_queue or fifo_priority is not None
        self.sent = 0
        self._builder = PayloadBuilder(client.app)
        self._events = bool(client.app.conf.task_send_sent_event)
        self._reply_to = client.app.thread_oid

    def record(
        self, planned: Planned, sched_s: float, on_done: Callable[[Record], None] | None
    ) -> Record:
        """The record of one planned request (its id, class, timeout, schedule), registered
        in the table and stamped as sent now."""
        prio = Priority.parse(planned.priority)
        rec = Record(
            id=str(uuid.uuid4()),
            rep=self.rep,
            phase=planned.phase,
            modality=planned.modality,
            priority=planned.priority,
            source=planned.source,
            input_index=planned.input_index,
            measured=planned.measured,
            timeout_s=planned.timeout_s or prio.default_timeout_s(self.client.settings),
            sched_ms=self.tb.wall_ms(sched_s),
            on_done=on_done,
        )
        rec.sent_ms = self.tb.now_ms()
        self.table.register(rec)
        return rec

    def send(
        self,
        items: list[tuple[Planned, float]],
        producer: object,
        on_done: Callable[[Record], None] | None = None,
    ) -> list[Record]:
        """Send ``(planned, scheduled monotonic time)`` pairs in order, pipelined as
        ``FleetClient.submit_many`` sends (:meth:`FleetClient.publish_many`: the same bytes
        and ``task-sent`` events as kombu's publish, a transaction per chunk), with this
        mode's queue and priority; return their records. ``producer`` is unused (the
        pipelined path takes a pooled connection per call)."""
        del producer
        out: list[Record] = []
        outgoing: list[tuple[Record, Outgoing]] = []
        for planned, sched_s in items:
            rec = self.record(planned, sched_s, on_done)
            out.append(rec)
            msg = self._message(planned, rec)
            if msg is not None:
                outgoing.append((rec, msg))
        sent = 0
        try:
            for n in self.client.publish_many([m for _, m in outgoing]):
                sent = n  # on Redis so far (whole chunks)
        except Exception as exc:
            log.warning("send failed: %s", exc)
            for rec, _ in outgoing[sent:]:
                self.table.complete(rec.id, self.tb.now_ms(), False, SEND_FAILED)
        self.sent += sent
        return out

    def _message(self, planned: Planned, rec: Record) -> Outgoing | None:
        """The message of ``planned`` under ``rec``'s id, or ``None`` (recorded at once with
        its code) when the client refuses the request."""
        inputs = self.catalog.get(planned.source, planned.input_index)
        try:
            env = self.client.envelope(planned.modality, inputs, planned.priority, rec.timeout_s)
        except FleetError as exc:
            self.table.complete(rec.id, self.tb.now_ms(), False, exc.code)
            return None
        fifo = self.fifo_priority is not None
        prio = Priority.parse(planned.priority)
        celery_prio = self.fifo_priority if fifo else prio.celery_priority(self.client.settings)
        # The fleet routes as FleetClient does (REALTIME to <modality>.realtime); the
        # baseline is plain Celery: one FIFO queue; celery-batches: one priority queue.
        queue = (
            schema.queue_name(env.modality)
            if self.one_queue
            else schema.queue_for(env.modality, env.priority)
        )
        return self._builder.build(env, rec.id, queue, celery_prio, self._reply_to, self._events)


class _GeneratorThread(threading.Thread):
    """A sending thread: holds one producer connection for its whole phase; records a crash
    in ``error`` (the runner reports it) instead of dying silently."""

    sender: Sender
    error: BaseException | None

    def run(self) -> None:
        try:
            with self.sender.client.app.producer_or_acquire() as producer:
                self._run(producer)
        except BaseException as exc:
            self.error = exc
            log.exception("%s failed", self.name)

    def _run(self, producer: object) -> None:
        raise NotImplementedError


class OpenLoop(_GeneratorThread):
    """Sends an open-loop schedule; ``t0`` is the repetition's start (monotonic seconds)."""

    def __init__(
        self,
        sender: Sender,
        plan: list[Planned],
        t0: float,
        stop: threading.Event,
        max_group: int = 32,
    ) -> None:
        super().__init__(name="bench-open-loop", daemon=True)
        self.sender = sender
        self.plan = plan
        self.t0 = t0
        self.stop_flag = stop
        self.max_group = max_group
        self.error: BaseException | None = None

    def _run(self, producer: object) -> None:
        plan, t0, n, i = self.plan, self.t0, len(self.plan), 0
        while i < n and not self.stop_flag.is_set():
            now = time.monotonic()
            due = t0 + plan[i].offset_s
            if due > now:
                time.sleep(min(due - now, 0.05))
                continue
            j = i
            while j < n and j - i < self.max_group and t0 + plan[j].offset_s <= now:
                j += 1
            self.sender.send([(p, t0 + p.offset_s) for p in plan[i:j]], producer)
            i = j


class ClosedLoop(_GeneratorThread):
    """Keeps ``phase.concurrency`` requests in flight for the phase's count or duration."""

    def __init__(
        self, sender: Sender, picker: ClosedPicker, t0: float, stop: threading.Event
    ) -> None:
        super().__init__(name=f"bench-closed-{picker.phase.name}", daemon=True)
        self.sender = sender
        self.picker = picker
        self.t0 = t0
        self.stop_flag = stop
        self.freed: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.error: BaseException | None = None

    def _on_done(self, _rec: Record) -> None:
        self.freed.put(1)

    def _run(self, producer: object) -> None:
        phase = self.picker.phase
        start = self.t0 + phase.start_s
        end = start + phase.duration_s if phase.duration_s else float("inf")
        limit = phase.count if phase.count is not None else 1 << 62
        while time.monotonic() < start and not self.stop_flag.is_set():
            time.sleep(min(start - time.monotonic(), 0.05))
        sent = self._send(min(int(phase.concurrency or 1), limit), producer)
        while sent < limit and not self.stop_flag.is_set():
            remaining = end - time.monotonic()
            if remaining <= 0:
                break
            try:
                self.freed.get(timeout=min(remaining, 0.1))
            except queue.Empty:
                continue
            k = 1
            while True:
                try:
                    self.freed.get_nowait()
                except queue.Empty:
                    break
                k += 1
            sent += self._send(min(k, limit - sent), producer)

    def _send(self, k: int, producer: object) -> int:
        now = time.monotonic()
        items = [(self.picker.next(now - self.t0), now) for _ in range(k)]
        self.sender.send(items, producer, on_done=self._on_done)
        return k
