"""What the bench knows about each request it sent, filled in by three threads.

- the generator registers a :class:`Record` just before it sends the message
  (:meth:`RecordTable.register`), so a result can never arrive for an unknown id;
- the result collector marks it done (:meth:`RecordTable.complete`) with the worker's
  ``date_done`` and the outcome;
- the event tap adds when the worker started it and how long its batch ran
  (:meth:`RecordTable.started`, :meth:`RecordTable.succeeded`).

Times are Unix epoch milliseconds (``*_ms``). The producer's schedule lives on its monotonic
clock and is translated to the wall clock once per run (:class:`Timebase`), so scheduled
times and the worker's timestamps (same machine, same clock) compare directly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# Bench-side codes for requests that never got a result from the fleet.
NO_RESULT = "NO_RESULT"  # no result within the drain timeout
SEND_FAILED = "SEND_FAILED"  # the broker refused the message


CLOCK_STEP_MS = 50.0  # a wall-clock step this large during a repetition is reported


def _wall_minus_monotonic_ms() -> float:
    return time.time() * 1000.0 - time.monotonic() * 1000.0


class Timebase:
    """Translate the producer's monotonic clock to epoch milliseconds, with one offset.

    Reading the wall clock once and adding monotonic deltas keeps scheduled times immune to
    wall-clock steps during the run; the residual error against the workers' ``time.time()``
    is a clock step (NTP) during the run, which the report cannot see.
    """

    def __init__(self) -> None:
        self.offset_ms = _wall_minus_monotonic_ms()

    def resync(self) -> float:
        """Read the offset again (the bench does before each repetition, so a step between
        repetitions, e.g. a VM paused and resumed, does not shift the later ones); returns
        the step in milliseconds (new offset minus old)."""
        old = self.offset_ms
        self.offset_ms = _wall_minus_monotonic_ms()
        return self.offset_ms - old

    def step_ms(self) -> float:
        """How far the wall clock moved against the monotonic clock since the offset was
        read (0 without a step; a few microseconds of jitter)."""
        return _wall_minus_monotonic_ms() - self.offset_ms

    def step_note(self, what: str) -> str | None:
        """A warning for the report when the wall clock stepped more than
        :data:`CLOCK_STEP_MS` since the offset was read during ``what``, else ``None``."""
        step = self.step_ms()
        if abs(step) <= CLOCK_STEP_MS:
            return None
        return (
            f"{what}: the wall clock stepped {step:+.0f} ms against the monotonic clock; "
            "its latencies and throughput are off by about that much"
        )

    def wall_ms(self, mono_s: float) -> float:
        return mono_s * 1000.0 + self.offset_ms

    def now_ms(self) -> float:
        return self.wall_ms(time.monotonic())


@dataclass(slots=True)
class Record:
    """One sent (or refused) request and what became of it."""

    id: str
    rep: int
    phase: str
    modality: str
    priority: str
    source: str
    input_index: int
    measured: bool
    timeout_s: float | None  # effective deadline from the scheduled time (None: no deadline)
    sched_ms: float  # scheduled send time
    sent_ms: float = 0.0  # when its send began (lag = sent_ms - sched_ms)
    done_ms: float | None = None  # worker's date_done (or the bench's, for bench codes)
    ok: bool | None = None  # None: no outcome yet
    code: str | None = None  # error code when not ok
    started_ms: float | None = None  # task-started event
    compute_ms: float | None = None  # task-succeeded runtime: the batch's model time
    batch_size: int | None = None  # from the fleet's task-succeeded summary
    on_done: Callable[[Record], None] | None = None

    @property
    def e2e_ms(self) -> float | None:
        """End-to-end latency from the scheduled send time."""
        return None if self.done_ms is None else self.done_ms - self.sched_ms

    @property
    def queue_ms(self) -> float | None:
        """From the scheduled send time until the worker started it."""
        return None if self.started_ms is None else self.started_ms - self.sched_ms

    @property
    def lag_ms(self) -> float:
        return self.sent_ms - self.sched_ms

    @property
    def missed_deadline(self) -> bool:
        """Failed with ``DEADLINE_EXCEEDED``, or succeeded later than its deadline."""
        if self.code == "DEADLINE_EXCEEDED":
            return True
        if self.timeout_s is None or not self.ok or self.e2e_ms is None:
            return False
        return self.e2e_ms > self.timeout_s * 1000.0


class RecordTable:
    """Thread-safe id -> :class:`Record` map of one repetition (or probe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, Record] = {}
        self.done = 0
        self.errors = 0
        self.strays = 0  # results for ids this table never sent (earlier repetitions)

    def register(self, rec: Record) -> None:
        with self._lock:
            self._records[rec.id] = rec

    def complete(self, task_id: str, done_ms: float | None, ok: bool, code: str | None) -> None:
        """Store an outcome; the first one wins (a redelivered task may store twice)."""
        with self._lock:
            rec = self._records.get(task_id)
            if rec is None:
                self.strays += 1
                return
            if rec.ok is not None:
                return
            rec.done_ms, rec.ok, rec.code = done_ms, ok, code
            self.done += 1
            self.errors += 0 if ok else 1
            callback = rec.on_done
        if callback is not None:
            callback(rec)

    def started(self, task_id: str, ts_ms: float) -> None:
        with self._lock:
            rec = self._records.get(task_id)
            if rec is not None and rec.started_ms is None:
                rec.started_ms = ts_ms

    def succeeded(self, task_id: str, runtime_ms: float | None, batch_size: int | None) -> None:
        with self._lock:
            rec = self._records.get(task_id)
            if rec is not None:
                rec.compute_ms = runtime_ms
                rec.batch_size = batch_size

    def pending_ids(self) -> list[str]:
        with self._lock:
            return [r.id for r in self._records.values() if r.ok is None]

    def records(self) -> list[Record]:
        with self._lock:
            return list(self._records.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)
