"""Admission control: ``QUEUE_FULL`` and ``DEADLINE_UNREACHABLE`` decided before sending.

Pure logic; the gateway feeds it queue depths (one ``LLEN`` pipeline per check) and the
completions it observes.

**QUEUE_FULL** (429): as :meth:`FleetClient.submit` decides it: the modality's queues hold
``max_queue_length`` requests, or the request's class holds its
``max_queue_length_by_priority`` limit.

**DEADLINE_UNREACHABLE** (429): a request with a deadline is refused when the requests that
run before it (those waiting in Redis at its priority or above, on its queue) cannot drain
before its deadline even at ``safety`` times the measured service rate::

    ahead / (safety * rate) > time_left

The service rate of a queue is measured from the completions this gateway observes (final
results of the requests it waits on), counted only since the queue was last seen empty in
Redis (a depth sample of 0 clears them; the gateway samples depth at every admission and
every 0.5 s while it waits on that queue): while a queue runs dry, completions follow
arrivals and say nothing about capacity. It needs ``min_samples`` such completions within
``window_s``, spread over at least 1 s, and the latest depth sample > 0. No such rate: admit.

What keeps it conservative: the requests held in
workers' prefetch windows are not counted ahead (fewer ahead), and ``safety`` (default 2)
covers a gateway that sees only part of the completions (other producers, other gateways on
the same queue: their completions are not counted, so the rate is underestimated).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

from shared import schema
from shared.settings import PRIORITY_NAMES, ModalityConfig

MIN_SPAN_S = 1.0  # completions must span this long for a rate to count


class RateMeter:
    """Completions per second of one queue, over a sliding window, since it was last empty.

    Args:
        window_s: the window (seconds); min_samples: completions needed inside it.
    """

    def __init__(self, window_s: float = 10.0, min_samples: int = 32) -> None:
        self.window_s = window_s
        self.min_samples = min_samples
        self._done: deque[float] = deque()
        self._last_depth: int | None = None
        self.last_activity = -math.inf  # monotonic time of the last completion or sample

    def _trim(self, now: float) -> None:
        cut = now - self.window_s
        while self._done and self._done[0] < cut:
            self._done.popleft()

    def observe_depth(self, now: float, depth: int) -> None:
        """A depth sample of the queue (requests waiting in Redis) at ``now`` (monotonic s);
        an empty queue clears the completions counted so far."""
        self._last_depth = depth
        if depth <= 0:
            self._done.clear()
        self._trim(now)

    def observe_completion(self, now: float) -> None:
        """One request of this queue reached its final result at ``now`` (monotonic s)."""
        self._done.append(now)
        self.last_activity = now
        self._trim(now)

    def rate(self, now: float) -> float | None:
        """Completions per second, or ``None`` when not confident (too few completions since
        the queue was last empty, too short a span, or no backlog in the latest sample)."""
        self._trim(now)
        n = len(self._done)
        if n < self.min_samples or not self._last_depth or self._last_depth <= 0:
            return None
        span = self._done[-1] - self._done[0]
        if span < MIN_SPAN_S:
            return None
        return (n - 1) / span


class SentJobs:
    """The queue of each job this gateway sent, until its completion is observed (a wait or
    a stream read its final result): what feeds :class:`RateMeter`. A job sent with
    ``Prefer: respond-async`` and never waited on is never observed, so the map is bounded:
    past ``limit`` jobs the oldest is forgotten (its completion, if ever read, is not counted:
    the rate is underestimated, the safe side)."""

    def __init__(self, limit: int = 65_536) -> None:
        self.limit = limit
        self._queue_of: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._queue_of)

    def sent(self, task_id: str, queue: str) -> None:
        self._queue_of[task_id] = queue
        if len(self._queue_of) > self.limit:
            self._queue_of.popitem(last=False)

    def observed(self, task_id: str) -> str | None:
        """The job's queue, once (``None``: not sent here, observed already, or forgotten)."""
        return self._queue_of.pop(task_id, None)


def ahead_of(priority: str, depth: dict[str, int]) -> int:
    """Requests in Redis that run before a new ``priority`` request on its queue.

    REALTIME requests have a queue of their own (``<modality>.realtime``); the others share
    one, served in class order: a ``normal`` request waits for ``high`` and ``normal`` ones.
    """
    if priority == "realtime":
        return depth.get("realtime", 0)
    order = [p for p in PRIORITY_NAMES if p != "realtime"]
    return sum(depth.get(p, 0) for p in order[: order.index(priority) + 1])


def queue_of(modality: str, priority: str, model: str | None = None) -> str:
    """The rate meter's key: the queue the request travels on (``model``: a model's table
    when it is not its modality's default; ``shared.model_routes``)."""
    return schema.queue_for(modality, priority, model)


def meter_queue(queue: str) -> tuple[str, str | None]:
    """``(modality, model)`` of a meter's queue (:func:`queue_of`)."""
    base = queue.removesuffix(".realtime")
    modality, sep, model = base.partition(schema.MODEL_QUEUE_SEP)
    return modality, (model if sep else None)


def queue_full(
    cfg: ModalityConfig | None, depth: dict[str, int], modality: str, priority: str
) -> str | None:
    """A ``QUEUE_FULL`` message when one more request of ``priority`` would pass a limit."""
    if cfg is None:
        return None
    total = sum(depth.values())
    if cfg.max_queue_length and total + 1 > cfg.max_queue_length:
        return f"{modality} queue holds {total} requests; the limit is {cfg.max_queue_length}"
    limit = cfg.max_queue_length_by_priority.get(priority)
    if limit is not None and depth.get(priority, 0) + 1 > limit:
        return (
            f"{modality}/{priority} queue holds {depth.get(priority, 0)} requests; "
            f"the limit is {limit}"
        )
    return None


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is refused, and when to retry (seconds, for ``Retry-After``)."""

    message: str
    retry_after_s: int


def deadline_refusal(
    ahead: int, rate_rps: float | None, time_left_s: float | None, safety: float
) -> Refusal | None:
    """Refuse when ``ahead`` requests cannot drain before the deadline even at ``safety``
    times the measured rate; ``None`` (admit) without a rate or a deadline.

    Args:
        ahead: requests that run before this one; rate_rps: measured completions per second
            (``None``: unknown); time_left_s: until the deadline (``None``: no deadline).
    """
    if rate_rps is None or rate_rps <= 0 or time_left_s is None or ahead <= 0:
        return None
    best_case_s = ahead / (safety * rate_rps)
    if best_case_s <= time_left_s:
        return None
    expected_s = ahead / rate_rps
    return Refusal(
        f"{ahead} requests are ahead of this one; at the measured {rate_rps:.1f} requests/s "
        f"they take about {expected_s:.2f} s (at least {best_case_s:.2f} s), longer than the "
        f"{max(time_left_s, 0.0):.3f} s left before its deadline",
        max(1, min(60, math.ceil(expected_s))),
    )
