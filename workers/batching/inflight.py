"""Before a batch runs: drop requests that already have a final result, count deaths.

One round trip per batch (``_BEGIN``), for every member:

- if ``fleet:final:<id>`` exists, the request already has its final result (a redelivered
  or duplicated copy of a finished request): it is not run, only acked
  (``workers.batching.results`` writes that marker with the first final result);
- else, on its first run in this delivery, its in-flight counter is incremented (the
  arrival's count was given back once it decoded).

The in-flight counter ``fleet:deliveries:<id>`` is incremented when a delivery arrives,
before its input is decoded (:meth:`InFlight.arrive`, one round trip per fetch), and given
back once it decoded (a worker dying while it waits in the window is not its fault); it is
incremented again when its batch runs, deleted with the final result, and given back when a
worker shuts down or returns the request unrun. What is left of it counts the deliveries
whose worker died decoding or running them: a delivery that finds ``MAX_DELIVERIES``
deaths is poison (``WORKER_LOST``). In-place retries of a transient fault run again in the
same delivery and are not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import TYPE_CHECKING, Any

from shared import keys

# redis stays out of the engine parts' imports (workers.batching.poison uses this)
if TYPE_CHECKING:
    from shared.redis_client import Waiter

MAX_DELIVERIES = 3  # deliveries whose worker died running them, after which a message is poison
FINAL = -1  # _BEGIN's answer for a request that has its final result already

# the batch gate (``inflight_begin.lua``: its KEYS, ARGV, reply and keys in its header)
_BEGIN = resources.files("workers.batching").joinpath("inflight_begin.lua").read_text("utf-8")


class InFlight:
    """The batch gate and the in-flight counters, on a Redis client (thread-safe).

    Args:
        client: a ``redis.Redis`` client.
        ttl_s: how long a counter outlives its last increment (it must outlive every
            redelivery of a dead worker's message).
        waiter: Redis behind Sentinel: a ``FINAL`` answer is confirmed on the primary
            before a copy is acked unrun. An old primary keeps answering until it is
            demoted, and a final marker it holds from a write no replica confirmed is lost
            with it; acking a copy on its word would lose the request.
    """

    def __init__(self, client: Any, ttl_s: int, waiter: Waiter | None = None) -> None:
        self.client = client
        self.waiter = waiter
        self.ttl_s = ttl_s
        self._begin = client.register_script(_BEGIN)

    def begin(self, task_ids: Sequence[str], count: Sequence[bool]) -> list[int]:
        """For each id: ``FINAL`` (do not run), its counter after counting, or 0 (not counted).

        Raises:
            redis.RedisError: Redis is unreachable (the caller runs the batch anyway:
                counting is a safety net, and result writes are first-wins).
        """
        if not task_ids:
            return []
        ks: list[str] = []
        for tid in task_ids:
            ks += [keys.final_key(tid), keys.delivery_count_key(tid)]
        args = [self.ttl_s, *("1" if c else "0" for c in count)]
        states = [int(x) for x in self._begin(keys=ks, args=args)]
        if self.waiter is not None and FINAL in states:
            finals = [i for i, st in enumerate(states) if st == FINAL]
            with self.client.pipeline(transaction=False) as pipe:
                for i in finals:
                    pipe.exists(keys.final_key(task_ids[i]))
                # ReplicationUncertain: the caller runs the batch (writes are first-wins)
                from shared.redis_client import execute_waiting

                found = execute_waiting(self.client, pipe, self.waiter)
            for i, present in zip(finals, found, strict=True):
                if not present:
                    states[i] = 0
        return states

    def arrive(self, task_ids: Sequence[str]) -> list[int]:
        """Count one delivery of each id; returns each counter (deliveries so far).

        Raises:
            redis.RedisError: Redis is unreachable.
        """
        if not task_ids:
            return []
        with self.client.pipeline(transaction=False) as pipe:
            for tid in task_ids:
                pipe.incr(keys.delivery_count_key(tid))
                pipe.expire(keys.delivery_count_key(tid), self.ttl_s)
            replies = pipe.execute()
        return [int(x) for x in replies[0::2]]

    def uncount(self, task_ids: Sequence[str]) -> None:
        """Give back the counts of requests that did not die (shutdown, returned unrun)."""
        if not task_ids:
            return
        with self.client.pipeline(transaction=False) as pipe:
            for tid in task_ids:
                pipe.decr(keys.delivery_count_key(tid))
            pipe.execute()
