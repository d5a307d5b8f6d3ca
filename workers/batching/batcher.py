"""The dynamic batching policy: which held requests run together, and when.

Pure logic: no Celery, no torch, no threads, no clock of its own (every call takes ``now``
in seconds on a monotonic clock). The engine feeds it the requests in the worker's prefetch
window and asks for the next batch.

Batching contract
=================
Ordering
    Held requests are ordered by priority class (REALTIME, HIGH, NORMAL, BULK), then by
    arrival. The first request in that order is the *head*; a batch only holds requests of
    the head's bucket (text: the token-length bucket; image: the image size), so padding
    only reaches the longest member of one bucket. They are taken by priority class, then
    nearest in length to the head, then by arrival: when the bucket holds more than a batch,
    the batch pads less (the ones left wait for a batch nearer their own length, or until
    they are the head themselves: nothing waits forever).
Expiry
    A request whose deadline has passed is never run: :meth:`Batcher.next_batch` removes it
    and returns it in ``expired``; the engine fails it with ``DEADLINE_EXCEEDED``.
Lanes
    With ``realtime_lane`` on, REALTIME requests form batches of their own for a second
    inference thread (the REALTIME lane: :meth:`Batcher.next_batch` with
    ``lane=Lane.REALTIME``), and the main lane never sees them: a REALTIME request then waits
    behind no lower-priority work at all, and lower-priority batches stay full.
Size
    At most ``max_batch_size`` requests and at most ``max_batch_bytes`` of staging memory
    (the head always fits alone). With ``preferred_batch_sizes``, a released batch has the
    largest preferred size that the bucket's requests can fill, else every request that fits
    (Triton's dynamic batcher: "If the dynamic batcher can form a batch of a preferred size(s)
    it will create a batch of the largest possible preferred size"; none preferred: the
    largest batch possible, Triton's default and its advice for most models). Without a
    REALTIME lane, while REALTIME traffic is present
    (a REALTIME request seen within ``realtime_grace_s``), a batch is also capped so that its
    predicted run time stays within ``realtime_budget_ms``: a REALTIME request then waits
    behind at most one short batch of lower-priority work, not a full one.
Flush triggers (a batch is released when any holds)
    1. FULL: the head's bucket holds ``max_batch_size`` requests (or the size cap).
    2. DELAY: the oldest request of the bucket has waited ``max_queue_delay_ms``.
    3. REALTIME: a REALTIME request is held.
    4. HIGH: more than ``max_high_waiting`` HIGH requests are held.
    5. MEMORY: the bucket's requests reach ``max_batch_bytes``.
    6. DEADLINE: waiting out the delay would make some request of the bucket miss its
       deadline, given the predicted run time of the batch.
    7. WINDOW: the prefetch window is full, so no further request can arrive to join.
    8. PREFERRED: the bucket's requests fill one of ``preferred_batch_sizes`` (Triton: "If a
       batch of one of these sizes can be formed it will be executed immediately"). With 1
       among them a lone request runs at once: for a model that gains little from batching
       (one CPU thread) this keeps latency low at light load, and under load the window
       still fills the larger sizes.
    Otherwise :meth:`Batcher.next_batch` returns no batch and the time at which to ask again.
Latency model
    ``predict_s(bucket, n) = a * n + b``, a least-squares fit over the recent
    ``(n, seconds)`` observations of each bucket (BentoML's adaptive batching fits the same
    linear model). Before two distinct sizes have been observed it predicts ``None`` and the
    size cap does not apply.
Acks and failures
    Not decided here: each request keeps its own Celery task; the engine acks each one after
    its own result is stored, and a failing request fails alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from shared.schema import Priority


class Lane(StrEnum):
    """Which inference thread asks: the main one, or the REALTIME lane's."""

    MAIN = "main"
    REALTIME = "realtime"


class Trigger(StrEnum):
    """Why a batch was released (recorded in metrics and the batch log line)."""

    FULL = "full"
    DELAY = "delay"
    REALTIME = "realtime"
    HIGH = "high"
    MEMORY = "memory"
    DEADLINE = "deadline"
    WINDOW = "window"
    PREFERRED = "preferred"


@dataclass(slots=True)
class Pending:
    """One held request as the policy sees it.

    Attributes:
        id: the Celery task id.
        priority: its class.
        arrival_s: when it entered the prefetch window (monotonic seconds).
        deadline_s: the monotonic time after which it must not run, or ``None``.
        bucket: batches never mix buckets.
        length: size inside the bucket (text: tokens).
        nbytes: staging bytes it adds to a batch.
        item: the engine's own object (opaque here).
    """

    id: str
    priority: Priority
    arrival_s: float
    deadline_s: float | None
    bucket: str
    length: int = 1
    nbytes: int = 0
    item: Any = field(default=None, repr=False)
    seq: int = 0

    def sort_key(self) -> tuple[int, float, int]:
        return (int(self.priority), self.arrival_s, self.seq)


@dataclass(frozen=True, slots=True)
class Policy:
    """Batching knobs. Units are in the names; see ``[modalities.*.batching]``."""

    max_batch_size: int = 8
    max_queue_delay_ms: float = 2.0
    max_batch_bytes: int = 256 * 1024 * 1024
    max_high_waiting: int = 5
    window_size: int = 0  # prefetch window (0 = unknown, WINDOW trigger off)
    realtime_budget_ms: float = 25.0
    realtime_grace_s: float = 1.0
    realtime_lane: bool = False
    preferred_batch_sizes: tuple[int, ...] = ()  # ascending, each <= max_batch_size

    def preferred_size(self, available: int) -> int | None:
        """The largest preferred size ``<= available``, or ``None``."""
        fits = [s for s in self.preferred_batch_sizes if s <= available]
        return max(fits) if fits else None


@dataclass(frozen=True, slots=True)
class Decision:
    """What :meth:`Batcher.next_batch` decided.

    Attributes:
        batch: requests to run now, in order (empty when waiting).
        trigger: why the batch was released (``None`` when waiting).
        expired: requests removed because their deadline passed.
        wake_at_s: when waiting, the monotonic time to ask again (``None``: only on arrival).
    """

    batch: list[Pending]
    trigger: Trigger | None
    expired: list[Pending]
    wake_at_s: float | None


class LatencyModel:
    """Per-bucket least-squares fit of batch run time: ``seconds = a * n + b``."""

    def __init__(self, window: int = 64) -> None:
        self._obs: dict[str, deque[tuple[int, float]]] = {}
        self._window = window
        self._fit: dict[str, tuple[float, float]] = {}

    def observe(self, bucket: str, n: int, seconds: float) -> None:
        """Record that a batch of ``n`` requests of ``bucket`` ran in ``seconds``."""
        obs = self._obs.setdefault(bucket, deque(maxlen=self._window))
        obs.append((n, seconds))
        xs = [o[0] for o in obs]
        if len(set(xs)) < 2:
            return
        mean_x = sum(xs) / len(xs)
        mean_y = sum(o[1] for o in obs) / len(obs)
        sxx = sum((x - mean_x) ** 2 for x in xs)
        sxy = sum((o[0] - mean_x) * (o[1] - mean_y) for o in obs)
        a = max(sxy / sxx, 0.0)
        b = max(mean_y - a * mean_x, 0.0)
        self._fit[bucket] = (a, b)

    def predict_s(self, bucket: str, n: int) -> float | None:
        """Predicted seconds for a batch of ``n``, or ``None`` before the fit exists."""
        fit = self._fit.get(bucket)
        return None if fit is None else fit[0] * n + fit[1]

    def max_size_within(self, bucket: str, budget_s: float, upper: int) -> int:
        """The largest ``n <= upper`` (at least 1) predicted to run within ``budget_s``."""
        fit = self._fit.get(bucket)
        if fit is None or fit[0] <= 0:
            return upper
        a, b = fit
        return max(1, min(upper, int((budget_s - b) / a)))


class Batcher:
    """Holds the prefetch window's requests and releases batches by the contract above."""

    def __init__(self, policy: Policy, model: LatencyModel | None = None) -> None:
        self.policy = policy
        self.model = model or LatencyModel()
        self._held: dict[str, Pending] = {}
        self._seq = 0
        self._last_realtime_s: float | None = None

    def __len__(self) -> int:
        return len(self._held)

    def add(self, p: Pending) -> None:
        """Hold a request. A REALTIME request starts (or extends) the REALTIME grace period."""
        self._seq += 1
        p.seq = self._seq
        self._held[p.id] = p
        if p.priority is Priority.REALTIME:
            self._last_realtime_s = p.arrival_s

    def remove(self, request_id: str) -> Pending | None:
        """Drop a held request (revoked, or handled elsewhere)."""
        return self._held.pop(request_id, None)

    def lane_of(self, p: Pending) -> Lane:
        """The lane that runs ``p``: REALTIME requests on the REALTIME lane when it is on."""
        if self.policy.realtime_lane and p.priority is Priority.REALTIME:
            return Lane.REALTIME
        return Lane.MAIN

    def realtime_present(self, now: float) -> bool:
        """True when a REALTIME request arrived within ``realtime_grace_s`` of ``now``."""
        last = self._last_realtime_s
        return last is not None and now - last <= self.policy.realtime_grace_s

    def size_cap(self, bucket: str, now: float) -> int:
        """Largest batch allowed now for ``bucket`` (max size, or the REALTIME time budget)."""
        cap = self.policy.max_batch_size
        if not self.policy.realtime_lane and self.realtime_present(now):
            cap = self.model.max_size_within(bucket, self.policy.realtime_budget_ms / 1e3, cap)
        return cap

    def next_batch(self, now: float, lane: Lane = Lane.MAIN) -> Decision:
        """Decide, at monotonic time ``now``, whether a batch runs for ``lane``, and which.

        Without ``realtime_lane`` every request is the main lane's.
        """
        expired = self._drop_expired(now)
        pool = self._lane_requests(lane)
        if not pool:
            return Decision([], None, expired, None)
        ordered = sorted(pool, key=Pending.sort_key)
        head = ordered[0]
        members = sorted(
            (p for p in ordered if p.bucket == head.bucket),
            key=lambda p: (int(p.priority), abs(p.length - head.length), p.arrival_s, p.seq),
        )
        cap = self.size_cap(head.bucket, now)
        trigger, wake_at = self._trigger(now, ordered, members, cap)
        batch = self._take(members, cap)
        preferred = self.policy.preferred_size(len(batch))
        if trigger is None and preferred is not None:
            trigger = Trigger.PREFERRED
        if trigger is None:
            return Decision([], None, expired, wake_at)
        if preferred is not None:
            batch = batch[:preferred]
        for p in batch:
            del self._held[p.id]
        return Decision(batch, trigger, expired, None)

    # -- internals ----------------------------------------------------------------------
    def _lane_requests(self, lane: Lane) -> list[Pending]:
        if not self.policy.realtime_lane:
            return list(self._held.values()) if lane is Lane.MAIN else []
        return [p for p in self._held.values() if self.lane_of(p) is lane]

    def _drop_expired(self, now: float) -> list[Pending]:
        gone = [p for p in self._held.values() if p.deadline_s is not None and now > p.deadline_s]
        for p in gone:
            del self._held[p.id]
        return gone

    def _take(self, members: list[Pending], cap: int) -> list[Pending]:
        batch: list[Pending] = []
        nbytes = 0
        for p in members:
            if len(batch) >= cap:
                break
            if batch and nbytes + p.nbytes > self.policy.max_batch_bytes:
                break
            batch.append(p)
            nbytes += p.nbytes
        return batch

    def _trigger(
        self, now: float, ordered: list[Pending], members: list[Pending], cap: int
    ) -> tuple[Trigger | None, float | None]:
        pol = self.policy
        if len(members) >= cap:
            return Trigger.FULL, None
        if ordered[0].priority is Priority.REALTIME:
            return Trigger.REALTIME, None
        if sum(p.priority is Priority.HIGH for p in ordered) > pol.max_high_waiting:
            return Trigger.HIGH, None
        if sum(p.nbytes for p in members) >= pol.max_batch_bytes:
            return Trigger.MEMORY, None
        if pol.window_size and len(self._held) >= pol.window_size:
            return Trigger.WINDOW, None
        delay_s = pol.max_queue_delay_ms / 1e3
        oldest = min(p.arrival_s for p in members)
        flush_at = oldest + delay_s
        if now >= flush_at:
            return Trigger.DELAY, None
        run_s = self.model.predict_s(members[0].bucket, min(len(members) + 1, cap)) or 0.0
        for p in members:
            if p.deadline_s is not None and flush_at + run_s > p.deadline_s:
                return Trigger.DEADLINE, None
        return None, flush_at
