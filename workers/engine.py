"""The per-process batching engine: prefetch window -> Batcher -> inference thread -> results.

Threads
-------
- The worker's event-loop thread (Celery's consumer) calls :meth:`Engine.on_request` for
  every message that enters the prefetch window, and :meth:`Engine.drain` when the inference
  thread signals completions through a self-pipe. Events, result writes and acks happen on
  this thread, as in a stock Celery worker.
- One inference thread asks the :class:`~workers.batcher.Batcher` for batches and runs them
  on the :class:`~workers.runtime.DeviceRuntime`. torch releases the GIL while it computes,
  so the loop keeps fetching messages meanwhile.

Per-request semantics
---------------------
Each request stays its own Celery task: ``task-received``, ``task-started``,
``task-succeeded``/``task-failed`` (and ``task-retried``) events, its own result, its own ack
after that result is stored (``acks_late``). A bad request fails alone: ``prepare`` and
``preprocess`` raise for it only, and a batch fault is bisected until the failing request is
alone (an out-of-memory batch is thereby split in halves; a single request that still does
not fit fails with ``DEVICE_OOM``).

Failure handling
----------------
- Transient faults (:class:`~shared.errors.TransientError`) are retried in place, up to the
  modality's ``max_retries``, after ``retry_backoff_s * 2**attempt``. Nothing else is retried.
- Leases (``workers.lease``): every message this worker holds is renewed by a thread of its
  own; a dead worker's messages return within ``lease_s``, a live one's never leave it.
- One final result per request: result writes are first-wins (``workers.results``); before a
  batch runs, members that already have a final result (a redelivered or duplicated copy)
  are acked without running (``workers.inflight``); a task id the window already holds is
  a *twin*: it waits for the first copy and is acked (or given back) with it.
- Poison messages: on a request's first run in a delivery its in-flight counter
  (``fleet:deliveries:<id>``) is incremented, and deleted with its result, or given back on a
  shutdown. A message redelivered after its worker died with it in flight is a *suspect*: it
  runs in a batch of its own, so it cannot take innocent requests down with it again; once
  its counter reaches ``MAX_DELIVERIES`` it fails with ``WORKER_LOST`` instead of running.
- Results or acks that Redis refuses (a restart, a dropped connection) are retried with
  backoff for ``SETTLE_GIVE_UP_S``; a request still unsettled then is given back to its
  queue, so its prefetch slot never stays taken.
- Shutdown (:meth:`Engine.stop`, on SIGTERM): the running batch and what the window holds
  run to the end for up to ``soft_shutdown_timeout_s``; the rest is given back at once.
- Revoked requests (``celery control revoke``) held in the window never run: ``REVOKED``.
- A per-model :class:`~workers.circuit.CircuitBreaker` opens after consecutive failed
  batches; while open, requests fail fast with ``CIRCUIT_OPEN``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import heapq
import itertools
import logging
import os
import socket
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from celery import Celery
from celery.worker import state as worker_state
from kombu.transport.virtual import QoS as VirtualQoS

from shared.errors import (
    CircuitOpen,
    DeadlineExceeded,
    DeviceError,
    DeviceOOM,
    FleetError,
    InvalidInput,
    InvalidMessage,
    ModelError,
    Revoked,
    UnsupportedModality,
    WorkerLost,
)
from shared.keys import delivery_count_key
from shared.metrics import FleetMetrics
from shared.priority import Priority
from shared.redis_client import Waiter
from shared.schema import TaskEnvelope
from shared.settings import Settings
from workers import broker, telemetry
from workers.acks import ack_batch
from workers.batcher import Batcher, Lane, Pending, Policy, Trigger
from workers.circuit import CircuitBreaker
from workers.faults import FaultInjector
from workers.inflight import FINAL, MAX_DELIVERIES, InFlight
from workers.lease import LeaseKeeper
from workers.models import make_adapter
from workers.models.base import Prepared
from workers.results import Outcome, ResultWriter
from workers.runtime import DeviceRuntime
from workers.telemetry import Tracing
from workers.tensor_lease import renew_inputs
from workers.warmup import WarmQueue, WarmStep, split_plan, warm_plan

log = logging.getLogger("fleet.engine")

TRIM_EVERY_BATCHES = 10  # give glibc's freed-but-kept heap pages back (see _trim_heap)
IN_FLIGHT_TTL_S = 7 * 86400
SETTLE_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)  # then every 2 s: Redis restarts take seconds
SETTLE_GIVE_UP_S = 60.0  # a result or ack still refused then: the request is given back
PROGRESS_INTERVAL_S = 0.25  # at most this often per request: progress is for humans


@dataclass(slots=True)
class Work:
    """A request held by the engine: the Celery request plus what the engine derived."""

    req: Any  # celery.worker.request.Request
    env: TaskEnvelope
    prepared: Prepared
    arrival_s: float  # monotonic
    fault: str | None = None
    attempts: int = 0
    started_s: float = 0.0
    batch_id: str = ""
    batch_size: int = 0
    counted: bool = False  # its in-flight counter was incremented for this delivery
    twins: list[Any] = field(default_factory=list)  # more copies of this task id, held


@dataclass(slots=True)
class _Progress:
    work: Work
    done: int
    total: int


@dataclass(slots=True)
class _Retry:
    work: Work
    error: FleetError
    countdown_s: float


@dataclass(slots=True)
class _Done:
    work: Work | None
    req: Any
    outcome: Outcome
    run_ms: float = 0.0
    priority: str = "unknown"  # for requests refused before they became Work
    stored: bool | None = None  # None: not yet written; False: the write failed
    duplicate: bool = False  # the request had its final result already: ack, write nothing
    acked: bool = False
    first_failure_s: float = 0.0  # monotonic time of the first refused store or ack
    attempts: int = 0  # store/ack attempts


_Posted = _Done | _Progress | _Retry | tuple[str, list[Work]]


@dataclass(slots=True)
class EngineStats:
    received: int = 0
    succeeded: int = 0
    failed: int = 0
    expired: int = 0
    retried: int = 0
    acked_in_batches: int = 0  # acks that shared a Redis pipeline (workers.acks)
    duplicates: int = 0  # copies acked without running or writing: a final result stood
    twins: int = 0  # copies of a task id the window held already
    revoked: int = 0
    settle_retries: int = 0  # result writes or acks retried after Redis refused them
    given_back: int = 0  # messages returned to their queue unrun (shutdown, unsettled)
    model_s: float = 0.0  # seconds the inference threads spent running batches (all lanes)
    batches: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)
    triggers: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)


class Engine:
    """Batching engine for one modality in one worker process.

    Args:
        modality: ``"text"``, ``"image"``, ...
        settings: fleet settings.
        app: the worker's Celery app (for the result backend).
        threaded: start the inference thread (batch mode); ``False`` for baseline mode,
            where Celery runs each task through :meth:`run_one`.
    """

    def __init__(
        self, modality: str, settings: Settings, app: Celery, *, threaded: bool = True
    ) -> None:
        cfg = settings.modality(modality)
        self.modality = modality
        self.cfg = cfg
        self.settings = settings
        self.app = app
        b = cfg.batching
        self.runtime = DeviceRuntime(cfg.device, lanes=2 if b.realtime_lane else 1)
        self.adapter = make_adapter(modality, settings, self.runtime)
        self.batcher = Batcher(
            Policy(
                max_batch_size=b.max_batch_size,
                max_queue_delay_ms=b.max_queue_delay_ms,
                max_batch_bytes=b.max_batch_bytes,
                max_high_waiting=b.max_high_waiting,
                window_size=cfg.device.prefetch_multiplier,
                realtime_budget_ms=b.realtime_budget_ms,
                realtime_lane=b.realtime_lane,
                preferred_batch_sizes=tuple(
                    sorted({s for s in b.preferred_batch_sizes if 1 <= s <= b.max_batch_size})
                ),
            )
        )
        self.breaker = CircuitBreaker(cfg.circuit_threshold, cfg.circuit_cooldown_s)
        self.faults = FaultInjector(settings.debug.fault_injection)
        self.writer = ResultWriter(app, Waiter.of(settings))
        ttl = max(IN_FLIGHT_TTL_S, settings.redis.visibility_timeout_s * (MAX_DELIVERIES + 1))
        self.inflight = InFlight(app.backend.client, int(ttl), Waiter.of(settings))
        self.keeper: LeaseKeeper | None = None
        self._by_id: dict[str, Work] = {}  # held or running, by task id (twins join these)
        self._arriving: dict[str, list[Any]] = {}  # arrived, not yet admitted -> its twins
        self._admitting: list[tuple[Any, TaskEnvelope]] = []
        self._running: dict[str, Work] = {}  # in a batch on an inference thread now
        self._hub: Any = None
        self._draining = False
        self.stats = EngineStats()
        self.metrics = FleetMetrics(modality, model=cfg.model)
        self.tracing = Tracing(settings, modality)
        telemetry.install(self.tracing)
        self._bind_gauges()
        self.ready = False
        # One lock, one condition per lane: an arrival wakes only the lane that will run it
        # (waking both made the idle REALTIME lane scan the whole window per BULK message).
        self._lock = threading.Lock()
        self._lane_cv = {lane: threading.Condition(self._lock) for lane in Lane}
        self._delayed: list[tuple[float, int, Pending]] = []  # retries waiting for backoff
        self._done: deque[_Posted] = deque()
        self._progress_at: dict[str, float] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._threads: list[threading.Thread] = []
        self._threaded = threaded
        self._stop = False
        self._trim_count = itertools.count(1)
        self._batch_seq = itertools.count(1)  # next() is atomic under the GIL: lanes share it
        self._host = socket.gethostname().split(".")[0]
        self._inline = False  # no event loop: complete on the inference thread
        self._warm_later = WarmQueue()  # buckets warmed by the idle main thread after ready

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Open the device, load the model, warm every bucket; then start the thread."""
        self.runtime.start()
        t0 = time.perf_counter()
        self.adapter.load()
        load_s = time.perf_counter() - t0
        if self.runtime.lanes > 1:
            self.runtime.install_yield_points(self.adapter.torch_modules())
        self.runtime.warmup(self._warmup)
        if self._threaded:
            lanes = [Lane.MAIN, Lane.REALTIME][: self.runtime.lanes]
            for i, lane in enumerate(lanes):
                t = threading.Thread(
                    target=self._loop, args=(lane, i), name=f"fleet-{lane}", daemon=True
                )
                t.start()
                self._threads.append(t)
            window, size = self.cfg.device.prefetch_multiplier, self.cfg.batching.max_batch_size
            if window < size:
                log.warning(
                    "prefetch window %d < max_batch_size %d: batches can never fill",
                    window,
                    size,
                )
        self.ready = True
        log.info(
            "engine ready modality=%s model=%s load_s=%.2f runtime=%s",
            self.modality,
            self.adapter.describe(),
            load_s,
            self.runtime.stats(),
        )

    def start_leases(self) -> None:
        """Start renewing the leases of every message this process holds (batch mode)."""
        from shared.redis_client import redis_client
        from workers import lease

        client = redis_client(
            self.settings, "worker", socket_timeout=5.0, socket_connect_timeout=2.0
        )
        self.keeper = LeaseKeeper(client, self.settings.redis.lease_renew_s)
        lease.install(self.keeper)
        self.keeper.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Shut down gracefully: finish the running batch and what the window holds for up
        to ``timeout_s`` (default: the modality's ``soft_shutdown_timeout_s``), then give
        the rest back to its queue at once. Called on the worker's shutdown, after Celery
        stopped consuming; results and acks are then written from the inference thread."""
        timeout_s = self.cfg.soft_shutdown_timeout_s if timeout_s is None else timeout_s
        self._admit()  # what arrived last, then what the loop thread had not handled yet
        self.drain()
        with self._lock:
            self._draining = True
            self._inline = True
            # Celery's event connection is closed by now: the inference thread must not
            # send events through it (progress, retried, started, succeeded).
            for w in self._by_id.values():
                for r in (w.req, *w.twins):
                    r._eventer = None
            self._notify_all()
        end = time.monotonic() + timeout_s
        while self._threaded and time.monotonic() < end and self._busy():
            time.sleep(0.05)
        with self._lock:
            self._stop = True
            self._notify_all()
        for t in self._threads:
            t.join(timeout=max(end - time.monotonic(), 0.0) + 1.0)
        self._give_back_rest()
        if self.keeper is not None:
            self.keeper.stop()

    def _busy(self) -> bool:
        with self._lock:
            return bool(len(self.batcher) or self._delayed or self._running)

    def _give_back_rest(self) -> None:
        """Return everything still held (unrun, or running past the shutdown timeout)."""
        with self._lock:
            works = list(self._by_id.values())
            self._by_id.clear()
        if not works:
            return
        counted = [w.req.id for w in works if w.counted]
        with contextlib.suppress(Exception):  # a shutdown is not a death: uncount
            self.inflight.uncount(counted)
        self._give_back([r for w in works for r in (w.req, *w.twins)])
        log.info("shutdown: gave back %d requests (%d were running)", len(works), len(counted))

    def _give_back(self, reqs: list[Any]) -> None:
        """Return messages to their queues at once, unrun (their prefetch slots are freed)."""
        tags = [r.message.delivery_tag for r in reqs if not r.acknowledged]
        if self.keeper is not None:
            self.keeper.give_back(tags)
        for r in reqs:
            if r.acknowledged:
                continue
            qos = getattr(r.message.channel, "qos", None)
            if qos is not None:
                VirtualQoS.ack(qos, r.message.delivery_tag)  # forget it: frees the slot
            r.acknowledged = True  # nothing may ack it any more: another worker owns it
            worker_state.task_ready(r)
            self.tracing.finished(r, None, outcome="given_back")
        self.stats.given_back += len(tags)

    def attach(self, hub: Any) -> None:
        """Complete requests on the consumer's event loop (``hub``), or inline if ``None``."""
        if hub is None:
            self._inline = True
            return
        self._hub = hub
        hub.add_reader(self._wake_r, self.drain)

    def _warmup(self) -> None:
        """Warm the buckets the worker needs before ready; queue the rest for the idle main
        thread (see :mod:`workers.warmup`; every bucket without an inference thread)."""
        pol = self.batcher.policy

        def largest(bucket: str | None) -> int:
            one = self.adapter.example_inputs(1, bucket)[0]
            per_request = max(self.adapter.prepare(one).nbytes, 1)
            return min(pol.max_batch_size, pol.max_batch_bytes // per_request)

        plan = warm_plan(self.adapter.buckets(), largest)
        before = self.cfg.batching.warmup_buckets_before_ready if self._threaded else None
        first, rest = split_plan(plan, before)
        for step in first:
            self._warm_step(step)
        self._warm_later = WarmQueue(rest)

    def _warm_step(self, step: WarmStep) -> None:
        inputs = self.adapter.example_inputs(step.n, step.bucket)
        samples = [self.adapter.preprocess(self.adapter.prepare(i)) for i in inputs]
        for _ in range(2):
            t0 = time.perf_counter()
            with self.runtime.batch_context():
                self.adapter.run_batch(samples)
            elapsed = time.perf_counter() - t0
        self.batcher.model.observe(step.bucket, step.n, elapsed)

    def run_one(self, request: dict[str, Any]) -> dict[str, Any]:
        """Run one request alone, in the calling thread (baseline mode: plain Celery).

        Raises:
            FleetError: bad input (with its code), an expired deadline, or a model fault.
        """
        env = TaskEnvelope.from_kwargs({"request": request})
        Priority.parse(env.priority)
        self._check_served(env)
        if env.expired():
            raise DeadlineExceeded("deadline passed before it could run")
        sample = self.adapter.preprocess(self.adapter.prepare(env.inputs))
        t0 = time.perf_counter()
        try:
            with self.runtime.batch_context():
                return self.adapter.run_batch([sample])[0]
        except Exception as exc:
            raise _as_fleet_error(exc) from None
        finally:
            self.stats.model_s += time.perf_counter() - t0

    def _check_served(self, env: TaskEnvelope) -> None:
        """Refuse an envelope for another modality, or naming a model this worker lacks.

        Raises:
            UnsupportedModality: ``env.modality`` is not this worker's.
            InvalidInput: ``env.model`` is set and is not the configured model's name.
        """
        if env.modality != self.modality:
            raise UnsupportedModality(
                f"modality {env.modality!r} sent to the {self.modality!r} queue"
            )
        if env.model is not None and env.model != self.cfg.model:
            raise InvalidInput(
                f"model {env.model!r} is not served; {self.modality} workers serve "
                f"{self.cfg.model!r} (or leave 'model' null)"
            )

    # -- loop thread: arrivals ----------------------------------------------------------
    def on_request(self, req: Any) -> None:
        """A message entered the prefetch window (event-loop thread).

        Cheap checks run here; decoding waits for :meth:`_admit`, which first counts the
        delivery in Redis (one round trip for every message of a fetch), so that a message
        whose decoding kills the worker is counted like one that kills it in a batch."""
        self.stats.received += 1
        self.metrics.eco.received(self.metrics.eco.queue_of(req))
        self.tracing.arrived(req)
        worker_state.task_reserved(req)
        with self._lock:
            first = self._by_id.get(req.id)
            if first is not None:  # a copy of a task id held already: runs once, with it
                first.twins.append(req)
                self.stats.twins += 1
                return
            if req.id in self._arriving:
                self._arriving[req.id].append(req)
                self.stats.twins += 1
                return
        label = "unknown"
        try:
            if req.args:
                raise InvalidInput(
                    "positional task arguments are not accepted; the envelope travels as "
                    "the keyword argument 'request'"
                )
            env = TaskEnvelope.from_kwargs(req.kwargs)
            # Only the four classes become metric labels: a producer sending arbitrary
            # priority strings must not create unbounded Prometheus series.
            Priority.parse(env.priority)
            label = env.priority
            self._check_served(env)
            if env.expired():  # waited in Redis past its deadline: do not even validate it
                raise DeadlineExceeded("deadline passed before it could run")
        except FleetError as exc:
            self._finish_now(req, exc, label)
            return
        with self._lock:
            self._arriving[req.id] = []
        self._admitting.append((req, env))
        if self._hub is not None and not self._inline:
            if len(self._admitting) == 1:  # after the rest of this fetch's messages
                self._hub.call_soon(self._admit)
        else:
            self._admit()

    def _admit(self) -> None:
        """Count the deliveries of the messages that arrived, then decode and hold them."""
        batch, self._admitting = self._admitting, []
        if not batch:
            return
        try:
            counts = self.inflight.arrive([req.id for req, _ in batch])
        except Exception:  # Redis away: count them when their batch runs instead
            log.warning("could not count %d arrivals", len(batch), exc_info=True)
            counts = [0] * len(batch)
        decoded = []
        for (req, env), count in zip(batch, counts, strict=True):
            with self._lock:
                twins = self._arriving.pop(req.id, [])
            if self._hold(req, env, count, twins) and count > 0:
                decoded.append(req.id)
        # Decoded without dying: waiting in the window is no fault of theirs (a worker that
        # dies now was not killed by them); they are counted again when their batch runs.
        try:
            self.inflight.uncount(decoded)
        except Exception:
            log.warning("could not uncount %d decoded arrivals", len(decoded), exc_info=True)

    def _hold(self, req: Any, env: TaskEnvelope, count: int, twins: list[Any]) -> bool:
        """Decode one request and give it to the batcher (``count``: its deliveries so far,
        this one included; 0 if not counted). False if it was refused instead."""
        try:
            deaths = count - 1
            if deaths >= MAX_DELIVERIES:
                raise WorkerLost(
                    f"its worker was lost {deaths} times while running it; not retried again"
                )
            if deaths > 0:
                log.info("redelivered id=%s died_in_flight=%d", req.id, deaths)
            inputs, fault = self.faults.split(env.inputs)
            # Its /dev/shm inputs live while it may run: renewed before prepare maps them.
            renew_inputs(self._worker_store, inputs, req.id)
            self.faults.on_prepare(fault)
            with self.tracing.in_request(req):
                prepared = self.adapter.prepare(inputs)
        except Exception as exc:  # an adapter bug must not kill the consumer either
            if not isinstance(exc, FleetError):
                log.exception("prepare failed id=%s", req.id)
                exc = InvalidInput(f"input could not be prepared: {exc}")
            for r in (req, *twins):
                self._finish_now(r, exc, env.priority)
            return False
        now = time.monotonic()
        work = Work(req, env, prepared, now, fault=fault, twins=twins)
        # A suspect of a crash gets a bucket of its own: it runs alone.
        bucket = f"{prepared.bucket}#suspect-{req.id}" if count > 1 else prepared.bucket
        pending = Pending(
            id=req.id,
            priority=Priority.parse(env.priority),
            arrival_s=now,
            deadline_s=_monotonic_deadline(env.deadline_ms),
            bucket=bucket,
            length=prepared.length,
            nbytes=prepared.nbytes,
            item=work,
        )
        with self._lock:
            self._by_id[req.id] = work
            self.batcher.add(pending)
            self._lane_cv[self.batcher.lane_of(pending)].notify()
        return True

    def _worker_store(self) -> Any:
        from shared.transport import process_store

        return process_store(self.settings, role="worker")

    def refuse(self, req: Any, exc: FleetError) -> None:
        """Fail a request at arrival with ``exc`` (stored first-wins, then acked)."""
        self._finish_now(req, exc)

    def refuse_message(self, message: Any, exc: Exception) -> None:
        """A message no request could be built from: a coded ``INVALID_MESSAGE`` result
        under its task id (when it has one), then acked. Never raises: the consumer must
        not die on a message (it would die again on its redelivery, forever)."""
        self.stats.received += 1
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

    def _finish_now(self, req: Any, exc: FleetError, priority: str = "unknown") -> None:
        self._complete([_Done(None, req, Outcome(req.id, error=exc), priority=priority)])

    # -- inference thread ---------------------------------------------------------------
    def _loop(self, lane: Lane = Lane.MAIN, index: int = 0) -> None:
        self.runtime.bind_lane(index)

        while True:
            cv = self._lane_cv[lane]
            with self._lock:
                while True:
                    if self._stop:
                        return
                    now = time.monotonic()
                    self._release_delayed(now)
                    d = self.batcher.next_batch(now, lane)
                    if d.batch or d.expired:
                        break
                    if lane is Lane.MAIN and len(self._warm_later) and not len(self.batcher):
                        break  # nothing waiting: warm one more bucket (outside the lock)
                    cv.wait(timeout=self._wait_s(d.wake_at_s, now))
            if not d.batch and not d.expired:
                try:
                    self._warm_later.run_one(self._warm_step)
                except Exception:  # a bucket that cannot warm runs cold; never kill the lane
                    log.exception("background warmup step failed")
                if not len(self._warm_later):
                    log.info("background warmup done: %d steps in %.2f s",
                             self._warm_later.done, self._warm_later.seconds)  # fmt: skip
                continue
            if d.expired:  # outside the lock: failing them writes to Redis
                self._expire(d.expired)
            if not d.batch:
                continue
            section = (
                self.runtime.realtime_section()
                if lane is Lane.REALTIME
                else contextlib.nullcontext()
            )
            try:
                with section:
                    self._run([p.item for p in d.batch], d.trigger)
            except Exception:  # never let the inference thread die silently
                log.exception("batch crashed; failing its requests")
                self._post(
                    [
                        _Done(p.item, p.item.req, Outcome(p.id, error=ModelError("batch crashed")))
                        for p in d.batch
                    ]
                )
            finally:
                with self._lock:
                    for p in d.batch:
                        self._running.pop(p.id, None)

    def _wait_s(self, wake_at_s: float | None, now: float) -> float | None:
        times = [t for t in (wake_at_s, self._delayed[0][0] if self._delayed else None) if t]
        return max(min(times) - now, 0.0) if times else None

    def _release_delayed(self, now: float) -> None:
        while self._delayed and self._delayed[0][0] <= now:
            _, _, pending = heapq.heappop(self._delayed)
            self.batcher.add(pending)
            self._lane_cv[self.batcher.lane_of(pending)].notify()

    def _notify_all(self) -> None:
        """Wake every lane (caller holds ``self._lock``)."""
        for cv in self._lane_cv.values():
            cv.notify_all()

    def _expire(self, expired: list[Pending]) -> None:
        self.stats.expired += len(expired)
        err = DeadlineExceeded("deadline passed before it could run")
        self._post([_Done(p.item, p.item.req, Outcome(p.id, error=err)) for p in expired])

    def _run(self, batch: list[Work], trigger: Trigger | None) -> None:
        with self.tracing.batch([w.req for w in batch]):
            self._run_batch(batch, trigger)

    def _run_batch(self, batch: list[Work], trigger: Trigger | None) -> None:
        batch_id = f"{self._host}-{os.getpid()}-{next(self._batch_seq)}"
        now = time.monotonic()
        for w in batch:
            w.started_s, w.batch_id, w.batch_size = now, batch_id, len(batch)
        self.stats.batches += 1
        self.stats.batch_sizes[len(batch)] += 1
        self.stats.triggers[str(trigger)] += 1
        if not self.breaker.allow(now):
            err = CircuitOpen(f"the {self.modality} model's circuit breaker is open")
            self._post([_Done(w, w.req, Outcome(w.req.id, error=err)) for w in batch])
            return
        self.runtime.yield_now()
        batch = self._begin(batch)
        if not batch:
            return
        self._post_started(batch)
        self.metrics.eco.started([self.metrics.eco.queue_of(w.req) for w in batch])
        done: list[_Done] = []
        ready: list[tuple[Work, Any]] = []
        for w in batch:
            self._sink_to([w])
            try:
                ready.append((w, self.adapter.preprocess(w.prepared)))
            except FleetError as exc:
                done.append(_Done(w, w.req, Outcome(w.req.id, error=exc)))
            except Exception as exc:
                done.append(_Done(w, w.req, Outcome(w.req.id, error=InvalidInput(str(exc)))))
        t0 = time.perf_counter()
        ran = self._run_isolating(ready)
        elapsed = time.perf_counter() - t0
        self.stats.model_s += elapsed
        if ready and all(d.outcome.error is None for d in ran):
            self.batcher.model.observe(batch[0].prepared.bucket, len(ready), elapsed)
        self._judge_model(ran)
        for d in ran:
            d.run_ms = elapsed * 1000.0
        if ran:
            self.metrics.observe_batch(len(ran), elapsed)
        self.runtime.yield_now()
        self._post(self._retry_transient(done + ran))
        if next(self._trim_count) % TRIM_EVERY_BATCHES == 0:
            _trim_heap()

    def _begin(self, batch: list[Work]) -> list[Work]:
        """The members to run: revoked ones end ``REVOKED``, ones with a final result are
        acked unrun; the others are counted in flight (first run of a delivery only)."""
        revoked = worker_state.revoked
        gone = [w for w in batch if w.req.id in revoked]
        if gone:
            self.stats.revoked += len(gone)
            err = Revoked("revoked before it ran")
            # Celery's revoke command stored REVOKED already (it does for reserved requests):
            # that document stands; ours is written only if it is missing.
            outs = [Outcome(w.req.id, error=err, keep_existing=True) for w in gone]
            self._post([_Done(w, w.req, o) for w, o in zip(gone, outs, strict=True)])
            batch = [w for w in batch if w.req.id not in revoked]
        try:
            states = self.inflight.begin([w.req.id for w in batch], [not w.counted for w in batch])
        except Exception:  # a safety net: run anyway (result writes are first-wins)
            log.warning("could not check or count batch in flight", exc_info=True)
            return batch
        dups = [w for w, st in zip(batch, states, strict=True) if st == FINAL]
        if dups:
            self.stats.duplicates += len(dups)
            self._post([_Done(w, w.req, Outcome(w.req.id), duplicate=True) for w in dups])
        run = []
        for w, st in zip(batch, states, strict=True):
            if st != FINAL:
                w.counted = w.counted or st > 0
                run.append(w)
        with self._lock:
            self._running.update((w.req.id, w) for w in run)
        return run

    def _judge_model(self, ran: list[_Done]) -> None:
        if not ran:
            return
        if any(d.outcome.error is None for d in ran):
            self.breaker.record_success()
        elif all(isinstance(d.outcome.error, ModelError | DeviceError) for d in ran):
            self.breaker.record_failure(time.monotonic())
            log.warning("model fault; breaker %s", self.breaker.snapshot())

    def _retry_transient(self, done: list[_Done]) -> list[_Done]:
        final: list[_Done] = []
        for d in done:
            err, w = d.outcome.error, d.work
            if err is None or w is None or not err.retryable or w.attempts >= self.cfg.max_retries:
                final.append(d)
                continue
            countdown = self.cfg.retry_backoff_s * (2**w.attempts)
            w.attempts += 1
            self.stats.retried += 1
            pending = Pending(
                id=w.req.id,
                priority=Priority.parse(w.env.priority),
                arrival_s=time.monotonic() + countdown,
                deadline_s=_monotonic_deadline(w.env.deadline_ms),
                bucket=w.prepared.bucket,
                length=w.prepared.length,
                nbytes=w.prepared.nbytes,
                item=w,
            )
            with self._lock:
                heapq.heappush(self._delayed, (pending.arrival_s, id(pending), pending))
                self._notify_all()  # whichever lane wakes first releases it when due
            self._post_item(_Retry(w, err, countdown))
        return final

    def _run_isolating(self, items: list[tuple[Work, Any]]) -> list[_Done]:
        """Run a batch; on a fault, bisect until the failing request fails alone."""
        if not items:
            return []
        self._sink_to([w for w, _ in items])
        try:
            self.faults.before_batch([(w.req.id, w.fault) for w, _ in items])
            with self.runtime.batch_context(), self.tracing.span("model.forward", n=len(items)):
                results = self.adapter.run_batch([s for _, s in items])
            return [
                _Done(w, w.req, Outcome(w.req.id, result=r))
                for (w, _), r in zip(items, results, strict=True)
            ]
        except Exception as exc:
            if len(items) == 1:
                w = items[0][0]
                return [_Done(w, w.req, Outcome(w.req.id, error=_as_fleet_error(exc)))]
            log.warning("batch of %d failed (%s); splitting", len(items), exc)
            mid = len(items) // 2
            return self._run_isolating(items[:mid]) + self._run_isolating(items[mid:])

    def _sink_to(self, works: list[Work]) -> None:
        def sink(index: int, done: int, total: int) -> None:
            w = works[index]
            now = time.monotonic()
            if done < total and now - self._progress_at.get(w.req.id, 0.0) < PROGRESS_INTERVAL_S:
                return
            self._progress_at[w.req.id] = now
            self._post_item(_Progress(w, done, total))

        self.adapter.progress_sink = sink

    # -- completions: posted by the inference thread, handled on the loop thread -------------
    def _post_started(self, batch: list[Work]) -> None:
        self._post_item(("started", batch))

    def _post(self, done: list[_Done]) -> None:
        if not done:
            return
        if self._inline:
            self._complete(done)
            return
        if self.runtime.on_realtime_lane:
            # A REALTIME lane's results are stored here, the moment its batch ends: its
            # client does not wait for the event loop, which may be busy with a batch of 32
            # completions. (The main lane leaves the encoding and the round trip to the loop
            # thread and goes on computing.) Events and acks follow on the loop thread
            # (kombu's channels are not thread-safe); the ack still comes after the result.
            self._store(done)
        self._done.extend(done)
        self._wake()

    def _store(self, done: list[_Done]) -> bool:
        """Write the final results of ``done`` (first-wins); duplicates write nothing."""
        todo = [d for d in done if not d.duplicate]
        for d in done:
            if d.duplicate:
                d.stored = True
        if not todo:  # copies counted at arrival: their counters go (best effort)
            with contextlib.suppress(Exception):
                self.app.backend.client.delete(*[delivery_count_key(d.req.id) for d in done])
            return True
        try:
            with self.tracing.result_write([d.req for d in todo]):
                written = self.writer.write(
                    [d.outcome for d in todo],
                    also_delete=[delivery_count_key(d.req.id) for d in todo],
                )
        except Exception as exc:
            # Not acked, still leased: retried with backoff (_settle_later).
            log.warning("storing %d results failed (%s); will retry", len(todo), exc)
            for d in todo:
                d.stored = False
            return False
        for d, ok in zip(todo, written, strict=True):
            d.stored = True
            if not ok:  # an earlier final result stands: this copy only needs its ack
                d.duplicate = True
                self.stats.duplicates += 1
        return True

    def _post_item(self, item: _Posted) -> None:
        if self._inline:
            self._handle([item])
            return
        self._done.append(item)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # pipe full: a wake-up is pending anyway
            os.write(self._wake_w, b"x")

    def drain(self) -> None:
        """Handle everything the inference thread posted (event-loop thread)."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass
        items: list[_Posted] = []
        while self._done:
            items.append(self._done.popleft())
        self._handle(items)

    def _handle(self, items: list[_Posted]) -> None:
        finished: list[_Done] = []
        for item in items:
            if isinstance(item, _Done):
                finished.append(item)
                continue
            if finished:  # keep event order: earlier completions first
                self._complete(finished)
                finished = []
            if isinstance(item, _Progress):
                self._progress(item)
            elif isinstance(item, _Retry):
                self.metrics.eco.retried(self.metrics.eco.queue_of(item.work.req))
                item.work.req.send_event("task-retried", exception=repr(item.error), traceback="")
            else:
                self._started(item[1])
        self._complete(finished)

    def _progress(self, p: _Progress) -> None:
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

    def _started(self, batch: list[Work]) -> None:
        for w in batch:
            if w.attempts == 0:
                w.req.on_accepted(os.getpid(), time.monotonic())

    def _complete(self, done: list[_Done]) -> None:
        """Store, ack and finish ``done``; what Redis refuses is retried later."""
        unstored = [d for d in done if not d.stored]
        if unstored:
            self._store(unstored)
        stored = [d for d in done if d.stored and not d.acked]
        if stored:
            reqs = [r for d in stored for r in (d.req, *(d.work.twins if d.work else ()))]
            try:
                self.stats.acked_in_batches += ack_batch(reqs, self.keeper)
                for d in stored:
                    d.acked = True
            except Exception as exc:  # stored, not acked: still leased, retried
                log.warning("acking %d requests failed (%s); will retry", len(reqs), exc)
        now = time.monotonic()
        left = []
        for d in done:
            if d.acked:
                self._finish_one(d, now)
            else:
                left.append(d)
        if left:
            self._settle_later(left, now)

    def _settle_later(self, done: list[_Done], now: float) -> None:
        """Retry storing/acking ``done`` with backoff; give them back after
        ``SETTLE_GIVE_UP_S`` (their prefetch slots must not stay taken for good)."""
        for d in done:
            d.first_failure_s = d.first_failure_s or now
            d.attempts += 1
        self.stats.settle_retries += len(done)
        if now - min(d.first_failure_s for d in done) >= SETTLE_GIVE_UP_S:
            log.error("%d requests could not be settled for %.0f s; giving them back",
                      len(done), SETTLE_GIVE_UP_S)  # fmt: skip
            self._give_back_unsettled(done)
            return
        delay = SETTLE_BACKOFF_S[min(done[0].attempts - 1, len(SETTLE_BACKOFF_S) - 1)]
        if self._hub is not None and not self._inline:
            self._hub.call_later(delay, self._complete, done)
        else:  # no event loop (draining, tests): this thread waits
            time.sleep(delay)
            self._complete(done)

    def _give_back_unsettled(self, done: list[_Done]) -> None:
        reqs = []
        for d in done:
            with self._lock:
                self._by_id.pop(d.req.id, None)
            reqs += [d.req, *(d.work.twins if d.work else ())]
        with contextlib.suppress(Exception):
            self.inflight.uncount([d.req.id for d in done if d.work and d.work.counted])
        self._give_back(reqs)

    def _finish_one(self, d: _Done, now: float) -> None:
        req, o, w = d.req, d.outcome, d.work
        with self._lock:
            if w is not None and self._by_id.get(req.id) is w:
                del self._by_id[req.id]
        for twin in w.twins if w else ():
            worker_state.task_ready(twin)
        if d.duplicate:
            worker_state.task_ready(req)
            log.info("request id=%s state=DUPLICATE (a final result stood; acked)", req.id)
            return
        if o.error is None:
            self.stats.succeeded += 1
            summary = (
                {
                    "batch_id": w.batch_id,
                    "batch_size": w.batch_size,
                    "queued_ms": round((w.started_s - w.arrival_s) * 1000.0, 2),
                    "run_ms": round(d.run_ms, 2),
                }
                if w
                else {}
            )
            req.send_event("task-succeeded", result=repr(summary), runtime=d.run_ms / 1000.0)
        else:
            self.stats.failed += 1
            self.stats.errors[o.error.code] += 1
            req.send_event("task-failed", exception=repr(o.error), traceback="")
        worker_state.task_ready(req)
        self.tracing.finished(req, o.error.code if o.error else None)
        self._progress_at.pop(req.id, None)
        queued_ms = (w.started_s - w.arrival_s) * 1000.0 if w and w.started_s else 0.0
        self.metrics.observe_request(
            w.env.priority if w else d.priority,
            "ok" if o.error is None else o.error.code,
            queued_ms / 1000.0 if w and w.started_s else None,
            (time.time() - w.env.submitted_ms / 1000.0) if w else None,
            self.metrics.eco.queue_of(req),
            d.run_ms / 1000.0 if w and w.started_s else None,
        )
        log.info(
            "request id=%s state=%s code=%s priority=%s queued_ms=%.1f run_ms=%.1f "
            "batch=%s size=%d attempts=%d total_ms=%.1f",
            req.id,
            o.state,
            o.error.code if o.error else "-",
            w.env.priority if w else "-",
            queued_ms,
            d.run_ms,
            w.batch_id if w else "-",
            w.batch_size if w else 0,
            (w.attempts + 1) if w else 0,
            (now - w.arrival_s) * 1000.0 if w else 0.0,
        )

    def snapshot(self) -> dict[str, Any]:
        """JSON-able stats for the ``fleet_stats`` control command and metrics."""
        s = self.stats
        return {
            "modality": self.modality,
            "ready": self.ready,
            "held": len(self.batcher),
            "received": s.received,
            "succeeded": s.succeeded,
            "failed": s.failed,
            "expired": s.expired,
            "retried": s.retried,
            "acked_in_batches": s.acked_in_batches,
            "duplicates": s.duplicates,
            "twins": s.twins,
            "revoked": s.revoked,
            "settle_retries": s.settle_retries,
            "given_back": s.given_back,
            "leases": self.keeper.snapshot() if self.keeper else None,
            "model_s": round(s.model_s, 6),
            "fetched_in_batches": broker.Channel.fetched_in_batches_total,
            "batches": s.batches,
            "batch_sizes": {str(k): v for k, v in sorted(s.batch_sizes.items())},
            "triggers": dict(s.triggers),
            "errors": dict(s.errors),
            "circuit": self.breaker.snapshot(),
            "runtime": self.runtime.stats(),
            "model": self.adapter.describe(),
        }

    def _bind_gauges(self) -> None:
        """Point-in-time gauges, read at scrape time."""
        m, metrics = self.modality, self.metrics
        metrics.held.labels(m).set_function(lambda: len(self.batcher))
        metrics.circuit_open.labels(m).set_function(lambda: float(self.breaker.state == "open"))
        metrics.eco.bind(lambda: len(self._running), lambda: len(self.batcher))
        metrics.device_memory.labels(m).set_function(
            lambda: (self.runtime.stats().get("cuda_reserved_mb") or 0.0) * 2**20
        )


def _monotonic_deadline(deadline_ms: float | None) -> float | None:
    """A wall-clock deadline (epoch ms, the producer's clock) on this process's monotonic clock."""
    if deadline_ms is None:
        return None
    return time.monotonic() + (deadline_ms - time.time() * 1000.0) / 1000.0


def _trim_heap() -> None:
    """Return freed heap memory to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Batches of varying shapes leave glibc holding freed arenas: the worker's RSS grew 10 %
    over a 10,000-request soak. A fixed ``MALLOC_MMAP_THRESHOLD_`` cured that but sent every
    tensor buffer through mmap/munmap and cost 20 % of text throughput in system time; a
    trim every ``TRIM_EVERY_BATCHES`` batches costs well under a millisecond each.
    """
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


def _as_fleet_error(exc: BaseException) -> FleetError:
    if isinstance(exc, FleetError):
        return exc
    if "out of memory" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError":
        return DeviceOOM(f"request does not fit in the worker's memory partition: {exc}")
    return ModelError(f"{type(exc).__name__}: {exc}")
