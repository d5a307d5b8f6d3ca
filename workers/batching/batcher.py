"""Dynamic batching: which held requests run together and when (:class:`Batcher`), the inference
threads that ask for and run those batches (:class:`Lanes`), and the model warmup they finish
(:class:`WarmQueue`). A held request is a :class:`Work`; the batcher sees it as a
:class:`Pending`.

The policy is pure logic: no Celery, no torch, no threads, no clock of its own (every call of
:class:`Batcher` takes ``now`` in seconds on a monotonic clock). The engine feeds it the requests in
the worker's prefetch window and asks for the next batch.

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

Warmup
======
Model warmup is split in two: what a worker warms before it says ready, and the rest later.
Warming a bucket runs it at batch size 1 and at the largest size it can reach
(``max_batch_size`` bounded by ``max_batch_bytes``), twice each: the first run pays one-time
costs (allocations, TorchScript's profiling runs), the second is timed and seeds the
batcher's latency model (Triton's ``model_warmup`` likewise runs the shapes the model will
see). A text model has a dozen length buckets, most of them rarely reached by short texts,
and warming them all before ready made a fresh worker wait several seconds for shapes it may
never run. So ``[batching] warmup_buckets_before_ready`` buckets (the shortest first) are
warmed before the worker takes traffic, and the others by the main inference thread whenever
it has no batch to run (:class:`WarmQueue`). A bucket a batch needs before it was warmed
simply pays its one-time costs in that batch; the latency model learns it from real batches.

Warming later only pays where a new shape's first run costs more than its next: on CUDA
(allocations, kernel selection per shape), not for a TorchScript model on the CPU, where
after the process's very first run a new shape runs as fast the first time as the second.
There a background step only takes a core (a batch of 32 at the longest bucket for seconds)
from the traffic, REALTIME included. :func:`warming_pays` decides from the steps warmed
before ready: without a first run notably slower than its second, nothing is left for later.

Lanes
=====
The inference threads (:class:`Lanes`): each waits for its lane's next batch and runs it. One
MAIN lane, plus a REALTIME lane when ``realtime_lane`` is on (REALTIME requests then form
batches of their own). One lock guards the batcher, the retry
delay queue and what is running; each lane waits on a condition of its own, so an arrival
wakes only the lane that will run it (waking both made the idle REALTIME lane scan the
whole window for every BULK message). Batches run outside the lock.

While nothing waits, the idle MAIN lane warms one more bucket at a time (:class:`WarmQueue`).

While REALTIME traffic flows (a REALTIME request held within the batcher's
``realtime_grace_s``) the MAIN lane hands each batch to a second main-lane thread in Linux's
``SCHED_IDLE`` class (:class:`IdleRunner`, ``main_lane_idle_while_realtime``): it runs only
on a core nothing else of normal class wants, so the kernel preempts it at once for the
REALTIME lane, the event loop (which reads, admits and acks REALTIME messages) and Redis,
at any instruction, inside a TorchScript graph too. Without REALTIME traffic batches run
on the MAIN thread itself (nice ``main_lane_nice``), so a saturated worker's throughput is
unchanged. A thread may enter ``SCHED_IDLE`` without privilege but not leave it, hence a
thread of its own rather than a switch.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from shared import clock
from shared.schema import Priority, TaskEnvelope
from workers.batching.fairshare import FairShare
from workers.models.base import Prepared
from workers.models.runtime import DeviceRuntime


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
    tenant: str | None = None  # None: the default tenant (shared.tenants)
    vstart: float = 0.0  # its start tag while fair share is on (workers.batching.fairshare)

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
    fair_share: bool = False  # tenants' weighted fair share within a class ([tenancy] share)
    tenant_weights: tuple[tuple[str, float], ...] = ()  # [tenants.*] weight; others weigh 1
    default_tenant: str = "default"

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
        # the held requests again by lane (each lane's batches come from its own), and how
        # many held have a deadline (none: no expiry scan)
        self._by_lane: dict[Lane, dict[str, Pending]] = {lane: {} for lane in Lane}
        self._deadlined = 0
        self._seq = 0
        self._last_realtime_s: float | None = None
        # Fair share: on while some held request names a tenant (_named of them); with none
        # named, the order is arrival's and workers.batching.fairshare never runs.
        self.fair = (
            FairShare(dict(policy.tenant_weights), policy.default_tenant)
            if policy.fair_share
            else None
        )
        self._named = 0

    def __len__(self) -> int:
        return len(self._held)

    def add(self, p: Pending) -> None:
        """Hold a request. A REALTIME request starts (or extends) the REALTIME grace period."""
        self._seq += 1
        p.seq = self._seq
        self._held[p.id] = p
        self._by_lane[self.lane_of(p)][p.id] = p
        self._deadlined += p.deadline_s is not None
        if p.priority is Priority.REALTIME:
            self._last_realtime_s = p.arrival_s
        if self.fair is not None and (self._named or p.tenant is not None):
            if not self._named:  # fair share starts: every held request gets its tag
                self.fair.retag(sorted(self._held.values(), key=Pending.sort_key))
            else:
                self.fair.tag(p)
            self._named += p.tenant is not None

    def remove(self, request_id: str) -> Pending | None:
        """Drop a held request (revoked, or handled elsewhere)."""
        p = self._held.pop(request_id, None)
        if p is not None:
            self._gone(p)
        return p

    def _gone(self, p: Pending) -> None:
        """``p`` is no longer held (dispatched, expired, removed)."""
        self._by_lane[self.lane_of(p)].pop(p.id, None)
        self._deadlined -= p.deadline_s is not None
        if p.tenant is not None and self._named:
            self._named -= 1

    def fair_now(self) -> bool:
        """Whether batches are formed by tenants' fair share now (some held request names a
        tenant, fair share on)."""
        return self.fair is not None and self._named > 0

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
        fair = self.fair if self._named else None
        if fair is None:  # the head alone decides: no need to order the whole pool
            head = min(pool, key=Pending.sort_key)
            members = sorted(
                (p for p in pool if p.bucket == head.bucket),
                key=lambda p: (int(p.priority), abs(p.length - head.length), p.arrival_s, p.seq),
            )
        else:  # tenants' turns before nearness in length (the bucket still bounds padding)
            ordered = sorted(pool, key=fair.key)
            head = ordered[0]
            members = [p for p in ordered if p.bucket == head.bucket]
        cap = self.size_cap(head.bucket, now)
        trigger, wake_at = self._trigger(now, head, pool, members, cap)
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
            self._gone(p)
        if fair is not None:
            fair.served(batch)
        return Decision(batch, trigger, expired, None)

    # -- internals ----------------------------------------------------------------------
    def _lane_requests(self, lane: Lane) -> list[Pending]:
        return list(self._by_lane[lane].values())

    def _drop_expired(self, now: float) -> list[Pending]:
        if not self._deadlined:
            return []
        gone = [p for p in self._held.values() if p.deadline_s is not None and now > p.deadline_s]
        for p in gone:
            del self._held[p.id]
            self._gone(p)
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
        self, now: float, head: Pending, pool: list[Pending], members: list[Pending], cap: int
    ) -> tuple[Trigger | None, float | None]:
        pol = self.policy
        if len(members) >= cap:
            return Trigger.FULL, None
        if head.priority is Priority.REALTIME:
            return Trigger.REALTIME, None
        if sum(p.priority is Priority.HIGH for p in pool) > pol.max_high_waiting:
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


@dataclass(frozen=True)
class WarmStep:
    """Run ``bucket`` at batch size ``n`` (twice; the second run is observed)."""

    bucket: str | None
    n: int


def warm_plan(
    buckets: Sequence[str | None], largest: Callable[[str | None], int]
) -> list[list[WarmStep]]:
    """Per bucket, in the adapter's order (shortest first), its steps: sizes 1 and ``largest``.

    Args:
        buckets: the adapter's buckets (``[None]`` for an adapter without buckets).
        largest: the largest batch size a bucket can reach (at least 1).
    """
    return [[WarmStep(b, n) for n in sorted({1, max(1, largest(b))})] for b in buckets]


def split_plan(
    plan: list[list[WarmStep]], before_ready: int | None
) -> tuple[list[WarmStep], list[WarmStep]]:
    """``(steps before ready, steps for later)``: the first ``before_ready`` buckets' steps
    first; ``None`` warms everything before ready (the baseline, which has no idle thread)."""
    k = len(plan) if before_ready is None else max(0, before_ready)
    first = [s for steps in plan[:k] for s in steps]
    rest = [s for steps in plan[k:] for s in steps]
    return first, rest


FIRST_RUN_EXCESS = 0.25  # a first run this much slower than the second: warming pays


FIRST_RUN_EXCESS_MIN_S = 0.005  # and at least this much (a few-ms run's jitter is not it)


def warming_pays(
    runs: Sequence[tuple[float, float]],
    excess: float = FIRST_RUN_EXCESS,
    min_excess_s: float = FIRST_RUN_EXCESS_MIN_S,
) -> bool:
    """Whether warming the rest of the plan pays on this device, from the ``(first_s,
    second_s)`` run times (seconds) of the steps warmed before ready, in order.

    The process's very first run is left out (it pays the model's one-time costs, which no
    later shape pays again). True when a later step's first run took longer than its second
    by more than ``excess`` of it and more than ``min_excess_s``, or when no step is left to
    judge by (warm as planned).
    """
    judged = list(runs)[1:]
    if not judged:
        return True
    return any(first - second > max(excess * second, min_excess_s) for first, second in judged)


class WarmQueue:
    """Warm steps left for later, taken one at a time by the idle main inference thread."""

    def __init__(self, steps: Sequence[WarmStep] = ()) -> None:
        self._steps: deque[WarmStep] = deque(steps)
        self._lock = threading.Lock()
        self.done = 0
        self.seconds = 0.0

    def __len__(self) -> int:
        return len(self._steps)

    def run_one(self, run: Callable[[WarmStep], Any]) -> bool:
        """Run the next step with ``run``; ``False`` when none is left."""
        with self._lock:
            if not self._steps:
                return False
            step = self._steps.popleft()
        t0 = time.perf_counter()
        run(step)
        self.done += 1
        self.seconds += time.perf_counter() - t0
        return True


log = logging.getLogger("fleet.engine")


class Lanes:
    """The lane threads of one engine.

    Args:
        batcher: holds the prefetch window's requests.
        runtime: the device (lane binding, the REALTIME section).
        run: runs one batch (``workers.batching.execution.BatchRunner.run``).
        crashed: fails a batch whose run raised (the lane thread must not die).
        expire: fails requests whose deadline passed while held.
        warm_step: warms one bucket.
        idle_while_realtime: run MAIN batches on an :class:`IdleRunner` while REALTIME
            traffic flows (two lanes only).
    """

    def __init__(
        self,
        batcher: Batcher,
        runtime: DeviceRuntime,
        *,
        run: Callable[[list[Work], Trigger | None], None],
        crashed: Callable[[list[Pending]], None],
        expire: Callable[[list[Pending]], None],
        warm_step: Callable[[WarmStep], object],
        idle_while_realtime: bool = False,
    ) -> None:
        self.batcher, self.runtime = batcher, runtime
        self.run, self.crashed, self.expire, self.warm_step = run, crashed, expire, warm_step
        self.lock = threading.Lock()
        self._cv = {lane: threading.Condition(self.lock) for lane in Lane}
        self._delayed: list[tuple[float, int, Pending]] = []  # retries waiting for backoff
        self.running: dict[str, Work] = {}  # in a batch on a lane thread now
        self.warm_later = WarmQueue()  # buckets warmed by the idle main lane after ready
        self._threads: list[threading.Thread] = []
        self._stop = False
        self.idle = IdleRunner(runtime) if idle_while_realtime and runtime.lanes > 1 else None

    def start(self) -> None:
        """Start one thread per lane of the runtime (and the idle-class runner)."""
        if self.idle is not None:
            self.idle.start()
        for i, lane in enumerate([Lane.MAIN, Lane.REALTIME][: self.runtime.lanes]):
            t = threading.Thread(
                target=self._loop, args=(lane, i), name=f"fleet-{lane}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def hold(self, pending: Pending) -> None:
        """Give ``pending`` to the batcher and wake its lane (caller holds ``lock``)."""
        self.batcher.add(pending)
        self._cv[self.batcher.lane_of(pending)].notify()

    def schedule(self, pending: Pending) -> None:
        """Hold a retry until its countdown passed (``pending.arrival_s``)."""
        with self.lock:
            heapq.heappush(self._delayed, (pending.arrival_s, id(pending), pending))
            self.wake_all()  # whichever lane wakes first releases it when due

    def wake_all(self) -> None:
        """Wake every lane (caller holds ``lock``)."""
        for cv in self._cv.values():
            cv.notify_all()

    def mark_running(self, works: list[Work]) -> None:
        with self.lock:
            self.running.update((w.req.id, w) for w in works)

    def busy(self) -> bool:
        with self.lock:
            return bool(len(self.batcher) or self._delayed or self.running)

    def stop(self, end_s: float) -> None:
        """Stop the lanes after their current batch; wait for them until ``end_s``
        (monotonic seconds) plus one second."""
        with self.lock:
            self._stop = True
            self.wake_all()
        for t in self._threads:
            t.join(timeout=max(end_s - time.monotonic(), 0.0) + 1.0)
        if self.idle is not None:
            self.idle.stop()

    def _loop(self, lane: Lane, index: int) -> None:
        self.runtime.bind_lane(index)
        while True:
            d = self._next(lane)
            if d is None:
                return
            if not d.batch and not d.expired:
                self._warm_one()
                continue
            if d.expired:  # outside the lock: failing them writes to Redis
                self.expire(d.expired)
            if d.batch:
                if lane is Lane.MAIN and self.idle is not None and self._realtime_flows():
                    self.idle.run(lambda d=d: self._run(lane, d.batch, d.trigger))
                else:
                    self._run(lane, d.batch, d.trigger)

    def _realtime_flows(self) -> bool:
        with self.lock:
            return self.batcher.realtime_present(time.monotonic())

    def _next(self, lane: Lane) -> Decision | None:
        """Wait for the lane's next batch (or expired requests, or a bucket to warm);
        ``None`` once stopped."""
        cv = self._cv[lane]
        with self.lock:
            while True:
                if self._stop:
                    return None
                now = time.monotonic()
                self._release_delayed(now)
                d = self.batcher.next_batch(now, lane)
                if d.batch or d.expired:
                    return d
                if lane is Lane.MAIN and len(self.warm_later) and not len(self.batcher):
                    return d  # nothing waiting: warm one more bucket (outside the lock)
                cv.wait(timeout=self._wait_s(d.wake_at_s, now))

    def _warm_one(self) -> None:
        try:
            self.warm_later.run_one(self.warm_step)
        except Exception:  # a bucket that cannot warm runs cold; never kill the lane
            log.exception("background warmup step failed")
        if not len(self.warm_later):
            log.info("background warmup done: %d steps in %.2f s",
                     self.warm_later.done, self.warm_later.seconds)  # fmt: skip

    def _run(self, lane: Lane, batch: list[Pending], trigger: Trigger | None) -> None:
        section = (
            self.runtime.realtime_section() if lane is Lane.REALTIME else contextlib.nullcontext()
        )
        try:
            with section:
                self.run([p.item for p in batch], trigger)
        except Exception:  # never let the inference thread die silently
            log.exception("batch crashed; failing its requests")
            self.crashed(batch)
        finally:
            with self.lock:
                for p in batch:
                    self.running.pop(p.id, None)

    def _wait_s(self, wake_at_s: float | None, now: float) -> float | None:
        times = [t for t in (wake_at_s, self._delayed[0][0] if self._delayed else None) if t]
        return max(min(times) - now, 0.0) if times else None

    def _release_delayed(self, now: float) -> None:
        while self._delayed and self._delayed[0][0] <= now:
            _, _, pending = heapq.heappop(self._delayed)
            self.hold(pending)


class IdleRunner:
    """A MAIN-lane thread in the ``SCHED_IDLE`` scheduling class that runs what the MAIN
    lane thread hands it, one call at a time, while the MAIN thread waits.

    ``idle_class`` says whether the kernel took the policy (Linux only; refused elsewhere,
    or by a seccomp profile: the runner then runs at the MAIN thread's priority, logged).
    ``batches`` counts the calls it ran.
    """

    def __init__(self, runtime: DeviceRuntime) -> None:
        self.runtime = runtime
        self.idle_class = False
        self.batches = 0
        self._cv = threading.Condition()
        self._job: Callable[[], None] | None = None
        self._done = False
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="fleet-main-idle", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=5.0)

    def run(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the idle-class thread and wait until it returned (it must not
        raise: the lanes' ``_run`` catches everything)."""
        with self._cv:
            self._job, self._done = job, False
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._done or self._stop)

    def _loop(self) -> None:
        self.runtime.bind_lane(0)  # the MAIN lane's stream, arena slot and yield points
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
            self.idle_class = True
            self.runtime.mark_idle_class()
        except (AttributeError, OSError) as exc:
            log.warning("main lane: SCHED_IDLE refused (%s); batches run at its priority", exc)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._job is not None or self._stop)
                if self._job is None:
                    return
                job = self._job
            try:
                job()
            finally:
                with self._cv:
                    self._job, self._done = None, True
                    self.batches += 1
                    self._cv.notify_all()


@dataclass(slots=True)
class Work:
    """A request held by the engine: the received request plus what the engine derived.

    Attributes:
        arrival_s: when it entered the prefetch window (monotonic seconds).
        fault: an injected fault spec (``workers.batching.inject``), or ``None``.
        attempts: in-place retries so far (0 on the first run).
        started_s: when its (last) batch started (monotonic seconds; 0.0 before).
        counted: a lane's blame record named it (it ran or runs in this delivery;
        ``workers.batching.admission``).
        suspect: an earlier delivery's worker died with it: it runs alone
        (``workers.batching.admission``).
        twins: more copies of this task id, held: acked (or given back) with it.
    """

    req: Any
    env: TaskEnvelope
    prepared: Prepared
    arrival_s: float
    fault: str | None = None
    attempts: int = 0
    started_s: float = 0.0
    batch_id: str = ""
    batch_size: int = 0
    counted: bool = False
    suspect: bool = False
    twins: list[Any] = field(default_factory=list)

    def pending(self, arrival_s: float, bucket: str | None = None) -> Pending:
        """This request as the batcher sees it, arriving at ``arrival_s`` (monotonic s);
        ``bucket`` overrides the prepared bucket (a suspect runs in a bucket of its own)."""
        return Pending(
            id=self.req.id,
            priority=Priority.parse(self.env.priority),
            arrival_s=arrival_s,
            deadline_s=monotonic_deadline(self.env.deadline_ms),
            bucket=self.prepared.bucket if bucket is None else bucket,
            length=self.prepared.length,
            nbytes=self.prepared.nbytes,
            item=self,
            tenant=self.env.tenant,
        )


def monotonic_deadline(deadline_ms: float | None) -> float | None:
    """A deadline (epoch ms on Redis' clock, ``shared.clock``) on this process's monotonic
    clock."""
    if deadline_ms is None:
        return None
    return time.monotonic() + (deadline_ms - clock.now_s() * 1000.0) / 1000.0
