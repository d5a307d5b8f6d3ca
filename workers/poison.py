"""Poison accounting: count the deliveries a worker died with, refuse a message that keeps
killing workers, and run a suspect alone.

The counters live in Redis (``workers.inflight``: keys, Lua gate, TTL); this module holds
the decisions and the safety nets around them, so they can be tested without Redis:

- a delivery is counted when it arrives (before its input is decoded), given back once it
  decoded, and counted again on its first run in a batch; the final result deletes it;
- what is left counts the deliveries whose worker died decoding or running them; a delivery
  that finds ``max_deliveries`` deaths fails ``WORKER_LOST`` instead of running;
- a delivery with an earlier death (a *suspect*) runs in a bucket of its own, so it cannot
  take innocent batch-mates down with it again;
- Redis refusing a count never stops a request: counting is a safety net, and result
  writes are first-wins.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Protocol

from shared.errors import WorkerLost
from workers.inflight import FINAL, MAX_DELIVERIES
from workers.work import Work

__all__ = ["Counters", "Deliveries", "suspect_bucket"]

log = logging.getLogger("fleet.engine")


class Counters(Protocol):
    """The in-flight counters (``workers.inflight.InFlight`` on Redis)."""

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
    def bucket(bucket: str, task_id: str, count: int) -> str:
        """The bucket a delivery counted ``count`` times runs in."""
        return suspect_bucket(bucket, task_id) if count > 1 else bucket

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
