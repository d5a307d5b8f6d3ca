"""Poison accounting: count the deliveries a worker died with, refuse a message that keeps
killing workers, and run a suspect alone.

The counters live in Redis (``workers.batching.inflight``: keys, Lua gate, TTL); this module holds
the decisions and the safety nets around them, so they can be tested without Redis:

- a delivery is counted when it arrives (before its input is decoded), given back once it
  decoded, and counted again on its first run in a batch; the final result deletes it;
- what is left counts the deliveries whose worker died decoding or running them; a delivery
  that finds ``max_deliveries`` deaths fails ``WORKER_LOST`` instead of running;
- a delivery with an earlier death (a *suspect*) runs in a bucket of its own, so it cannot
  take innocent batch-mates down with it again, and alone on the worker (:class:`Isolation`):
  no other batch runs and no arrival is being decoded meanwhile, and the batches before it
  have their results stored (a finished batch whose results the loop had not yet written is
  still counted: ``workers.batching.execution`` waits for the loop), its own stored before the next
  batch starts, so a death while it runs is blamed on it only;
- an arrival group is given back (uncounted) before any of its members may run, so a member
  that kills the worker is not blamed twice, nor its group-mates once;
- Redis refusing a count never stops a request: counting is a safety net, and result
  writes are first-wins.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from shared.errors import WorkerLost
from workers.batching.inflight import FINAL, MAX_DELIVERIES
from workers.batching.work import Work

__all__ = ["Counters", "Deliveries", "Isolation", "suspect_bucket"]

log = logging.getLogger("fleet.engine")


class Counters(Protocol):
    """The in-flight counters (``workers.batching.inflight.InFlight`` on Redis)."""

    def arrive(self, task_ids: Sequence[str]) -> list[int]: ...

    def begin(self, task_ids: Sequence[str], count: Sequence[bool]) -> list[int]: ...

    def uncount(self, task_ids: Sequence[str]) -> None: ...


def suspect_bucket(bucket: str, task_id: str) -> str:
    """The bucket of a suspect: its own, so no batch-mate joins it."""
    return f"{bucket}#suspect-{task_id}"


class Deliveries:
    """One worker's poison accounting over ``counters``.

    Args:
        counters: the in-flight counters.
        max_deliveries: deaths after which a message is refused (``WORKER_LOST``).
    """

    def __init__(self, counters: Counters, max_deliveries: int = MAX_DELIVERIES) -> None:
        self.counters = counters
        self.max_deliveries = max_deliveries

    def arrive(self, task_ids: Sequence[str]) -> list[int]:
        """Count one delivery of each id; each one's deliveries so far (0: not counted)."""
        try:
            return self.counters.arrive(task_ids)
        except Exception:  # Redis away: count them when their batch runs instead
            log.warning("could not count %d arrivals", len(task_ids), exc_info=True)
            return [0] * len(task_ids)

    def decoded(self, task_ids: Sequence[str]) -> None:
        """These decoded without dying: waiting in the window is no fault of theirs (a
        worker that dies now was not killed by them); their batch counts them again."""
        try:
            self.counters.uncount(task_ids)
        except Exception:
            log.warning("could not uncount %d decoded arrivals", len(task_ids), exc_info=True)

    def refusal(self, task_id: str, count: int) -> WorkerLost | None:
        """The error that refuses a delivery counted ``count`` times (this one included),
        or ``None`` if it may run."""
        deaths = count - 1
        if deaths >= self.max_deliveries:
            return WorkerLost(
                f"its worker was lost {deaths} times while running it; not retried again"
            )
        if deaths > 0:
            log.info("redelivered id=%s died_in_flight=%d", task_id, deaths)
        return None

    @staticmethod
    def suspect(count: int) -> bool:
        """Whether a delivery counted ``count`` times (this one included) had a worker die
        with it before: it then runs alone, in a bucket of its own."""
        return count > 1

    @classmethod
    def bucket(cls, bucket: str, task_id: str, count: int) -> str:
        """The bucket a delivery counted ``count`` times runs in."""
        return suspect_bucket(bucket, task_id) if cls.suspect(count) else bucket

    def begin(self, batch: list[Work]) -> tuple[list[Work], list[Work]]:
        """Split ``batch`` into (to run, duplicates with a final result already); counts the
        members not counted at arrival."""
        try:
            states = self.counters.begin([w.req.id for w in batch], [not w.counted for w in batch])
        except Exception:  # a safety net: run anyway (result writes are first-wins)
            log.warning("could not check or count batch in flight", exc_info=True)
            return batch, []
        run, dups = [], []
        for w, st in zip(batch, states, strict=True):
            if st == FINAL:
                dups.append(w)
            else:
                w.counted = w.counted or st > 0
                run.append(w)
        return run, dups

    def release(self, works: Sequence[Work]) -> None:
        """Give back the counts of requests that did not die (a shutdown, returned unrun)."""
        with contextlib.suppress(Exception):
            self.counters.uncount([w.req.id for w in works if w.counted])


class Isolation:
    """Who may run beside whom, so that a worker's death is blamed only on what caused it.

    A *suspect* batch (a delivery whose worker died before) runs alone: it waits until no
    other batch runs and no arrival group is counted-but-not-given-back (decoding), and
    while it waits or runs no other batch starts and arrivals are not counted. Other
    batches run beside each other and beside decoding arrivals (a first death may blame a
    decoding request once; its redelivery is then a suspect and runs alone).

    Batch threads block here; the consumer's event loop never does: :meth:`try_admit`
    answers at once, and ``on_clear`` (any thread) is called once the last suspect ends so
    that the deferred arrivals are admitted then.
    """

    def __init__(self, on_clear: Callable[[], None] | None = None) -> None:
        self.on_clear = on_clear or (lambda: None)
        self._cond = threading.Condition()
        self._batches = 0  # other batches running
        self._admitting = 0  # arrival groups counted, not yet given back
        self._suspects = 0  # suspects running or waiting to
        self._suspect_running = False

    def try_admit(self, block: bool = False) -> bool:
        """Start counting an arrival group; ``False`` (when not ``block``) while a suspect
        runs or waits: count it once :attr:`on_clear` is called."""
        with self._cond:
            if self._suspects and not block:
                return False
            self._cond.wait_for(lambda: not self._suspects)
            self._admitting += 1
            return True

    def admitted(self) -> None:
        """The group started by :meth:`try_admit` is given back (or failed to count)."""
        with self._cond:
            self._admitting -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def running(self, suspect: bool) -> Iterator[None]:
        """Hold while a batch runs (batch threads); a suspect one runs alone."""
        with self._cond:
            if suspect:
                self._suspects += 1
                self._cond.wait_for(
                    lambda: not (self._batches or self._admitting or self._suspect_running)
                )
                self._suspect_running = True
            else:
                self._cond.wait_for(lambda: not self._suspects)
                self._batches += 1
        clear = False
        try:
            yield
        finally:
            with self._cond:
                if suspect:
                    self._suspects -= 1
                    self._suspect_running = False
                    clear = not self._suspects
                else:
                    self._batches -= 1
                self._cond.notify_all()
            if clear:
                self.on_clear()

    def snapshot(self) -> dict[str, int]:
        """Counts now (for tests and stats)."""
        with self._cond:
            return {
                "batches": self._batches,
                "admitting": self._admitting,
                "suspects": self._suspects,
            }
