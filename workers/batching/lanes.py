"""The inference threads (lanes): each waits for its lane's next batch and runs it.

One MAIN lane, plus a REALTIME lane when ``realtime_lane`` is on (``workers.batching.batcher``:
REALTIME requests then form batches of their own). One lock guards the batcher, the retry
delay queue and what is running; each lane waits on a condition of its own, so an arrival
wakes only the lane that will run it (waking both made the idle REALTIME lane scan the
whole window for every BULK message). Batches run outside the lock.

While nothing waits, the idle MAIN lane warms one more bucket at a time
(``workers.batching.warmup``).

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
from collections.abc import Callable

from workers.batching.batcher import Batcher, Decision, Lane, Pending, Trigger
from workers.batching.warmup import WarmQueue, WarmStep
from workers.batching.work import Work
from workers.models.runtime import DeviceRuntime

__all__ = ["IdleRunner", "Lanes"]

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
