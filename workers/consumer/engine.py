"""The per-process batching engine: it wires the parts below into lanes and a lifecycle.

One concern per module; of them only this one imports Celery or kombu::

    Celery consumer --on_request--> admission (screen, admit) --Pending--> Batcher
    lanes (threads) --batch--> execution.BatchRunner --post--> completion.Handoff
    event loop --drain--> completion.Completer: events, result store, acks, log line

Also :mod:`workers.batching.admission` (blame records, ``WORKER_LOST``, suspects) and
:mod:`workers.batching.completion` (what the parts pass each other). The engine is the parts'
host (``execution.RunnerHost``, ``completion.CompletionHost``): it owns what is held.

Threads
-------
- The worker's event-loop thread (Celery's consumer) calls :meth:`Engine.on_request` for
  every message that enters the prefetch window, and drains completions when an inference
  thread posted some (a self-pipe). Events, result writes and acks happen on this thread,
  as in a stock Celery worker.
- One inference thread per lane (MAIN, and REALTIME when ``realtime_lane`` is on) asks the
  :class:`~workers.batching.batcher.Batcher` for batches and runs them on the
  :class:`~workers.models.runtime.DeviceRuntime`. torch releases the GIL while it computes, so the
  loop keeps fetching messages meanwhile.

Per request
-----------
Each request stays its own Celery task (its events, result and ``acks_late`` ack after the
result is stored); a bad request fails alone (``workers.batching.execution``). Leases
(``workers.consumer.lease``) bring a dead worker's messages back within ``lease_s``; results
are first-wins (``workers.batching.completion``) and a copy with a final result is acked
without running (``workers.batching.admission``; a task id already held is a *twin* and
settles with the first copy); poison and suspects: ``workers.batching.admission``; unsettled
results or acks: ``workers.batching.completion``.
On SIGTERM (:meth:`Engine.stop`) the running batch and the window run for up to
``soft_shutdown_timeout_s``, the rest is given back; revoked requests held never run.


Celery's front door ------------------- :func:`batching_strategy` is the task strategy that hands
each received message to the engine. Celery calls a task's *strategy* for every message of that task
that enters the worker's prefetch window; the default strategy executes it in the pool. This one
builds the same :class:`celery.worker.request.Request` (so ids, events, acks and ``inspect`` behave
as usual), sends ``task-received``, and gives the request to :class:`Engine` instead. Revoked and
expired messages are dropped as by the default strategy. A message no request can be built from (a
body that is not Celery's ``[args, kwargs, embed]``, broken headers) gets a coded
``INVALID_MESSAGE`` failure and is acked: it must not crash the consumer (the worker would die on it
at every restart). ETA/countdown is not supported for inference requests: such a message fails
``ETA_NOT_SUPPORTED`` (the producer refuses it at submit; this covers other clients).

Arrivals in groups: kombu delivers each message through its consumer's callback
(``Consumer._receive_callback``), which calls Celery's ``on_task_received`` (the task's name
read from the headers, its strategy looked up, two ``vine`` promises built for the ack and the
reject), which calls the strategy: per message, on the loop thread. :class:`FrontDoor` is the
receiver the worker's channel hands a take's messages to at once
(``workers.consumer.channel.install_receiver``): a message of a task whose strategy is this one,
with a body the channel decoded already, goes straight to the strategy's arrival with the ack
and reject callables Celery's promises wrap (the consumer's ``call_soon_ack`` of the message's
``ack_log_error`` / ``reject_log_error``), its errors reported as ``on_task_received`` reports
them; every other message goes to its callback, and so does every message while the consumer
restores its prefetch count after a connection restart (Celery chains that onto the promises).

Task events leave coalesced (:func:`coalesce_task_events`): a Celery worker on an event loop buffers
task events (``task-received``, ``task-started``, ``task-succeeded``, ...) and flushes them as one
``task.multi`` message, but it schedules that flush for the very next loop turn after every buffered
event (``Consumer.on_send_event_buffered``), and kombu's Redis transport sends each flush as its
own blocking PUBLISH. With one BRPOP per message, every arriving message then costs a PUBLISH round
trip on the loop thread, a large share of its time (see docs/decisions.md, "Event coalescing"). Here
the flush waits up to ``flush_interval_ms`` (or until ``buffer_limit`` events are buffered, Celery's
own inline flush), so a batch's events leave together.

Event timestamps are taken when each event is created, so Flower and the bench see the
same times; only their delivery is later, by at most the interval. As with Celery's own
buffer, events still buffered when the worker shuts down are not sent (at most one
interval's worth); results and acks do not depend on them. A group's events are built at
once (:class:`TaskEvents`: the same fields Celery's ``send_event`` gives, its per-event work
done once per group) and appended to the dispatcher's ``task`` buffer.

Private kombu/Celery names (read from 5.7.0; ``tests/unit/test_private_names.py``):
    celery.events.dispatcher.EventDispatcher: _group_buffer
    celery.worker.request.Request: _eventer, _terminate_on_ack
    celery.worker.consumer.consumer.Consumer: _maximum_prefetch_restored, _new_prefetch_count
    celery.worker.state: all_total_count
    kombu.message.Message: _decoded_cache


:func:`current` is the one engine of this worker process (a worker process owns exactly one
device slot), installed by ``workers.consumer.app`` when the worker starts.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from celery import Celery
from celery.exceptions import InvalidTaskError
from celery.utils.imports import symbol_by_name
from celery.utils.time import utcoffset as celery_utcoffset
from celery.worker import state as worker_state
from celery.worker.request import create_request_cls
from celery.worker.strategy import hybrid_to_proto2, proto1_to_proto2
from kombu.exceptions import ContentDisallowed, DecodeError

from shared import tenant_quota
from shared.errors import (
    DeadlineExceeded,
    EtaNotSupported,
    FleetError,
    InvalidMessage,
    ModelError,
    Revoked,
)
from shared.metrics import FleetMetrics
from shared.redis_client import Waiter
from shared.schema import TaskEnvelope
from shared.settings import Settings
from shared.tracing import Tracing
from workers.batching import refusals
from workers.batching.admission import (
    MAX_DELIVERIES,
    Admission,
    Deliveries,
    InFlight,
    Isolation,
    Refusal,
    Served,
    redelivered,
    screen,
)
from workers.batching.batcher import (
    Batcher,
    Lanes,
    Pending,
    Policy,
    WarmQueue,
    WarmStep,
    Work,
    split_plan,
    warm_plan,
    warming_pays,
)
from workers.batching.completion import (
    Completer,
    Done,
    EngineStats,
    Handoff,
    Loop,
    Observers,
    Outcome,
    Posted,
    ProgressThrottle,
    ResultWriter,
)
from workers.batching.execution import BatchRunner, CircuitBreaker, RetryPolicy
from workers.batching.inject import RequestInjector
from workers.consumer import stats
from workers.consumer.lease import AckPlan, LeaseKeeper, ack_batch, give_back, plan_acks
from workers.models import make_models
from workers.models.runtime import DeviceRuntime

__all__ = ["Engine"]


log = logging.getLogger("fleet.engine")


def _queue_models(engine: Engine) -> dict[str, str]:
    """Queue -> model table of the queues a worker of several models consumes (its
    metrics label each request with its queue's model); empty for one model."""
    if engine.models == [engine.cfg.model]:
        return {}
    from shared.model_routes import worker_models, worker_queues

    out: dict[str, str] = {}
    for m in worker_models(engine.settings, engine.modality, ",".join(engine.models)):
        for q in worker_queues([m], realtime_apart=False)[0]:
            out[q] = m.table
    return out


IN_FLIGHT_TTL_S = 7 * 86400  # least TTL of a blame record (workers.batching.admission)


def lease_client(settings: Settings) -> Any:
    """The Redis client the lease keeper renews, acks and gives back through (the primary,
    through the sentinels when they are configured)."""
    from shared.redis_client import redis_client

    return redis_client(settings, "worker", socket_timeout=5.0, socket_connect_timeout=2.0)


class Engine:
    """Batching engine for one modality in one worker process.

    Args:
        modality: ``"text"``, ``"image"``, ...
        settings: fleet settings.
        app: the worker's Celery app (for the result backend).
        threaded: start the inference threads (batch mode); ``False`` for baseline mode,
            where Celery runs each task through :meth:`run_one`.
        models: the ``[models.<name>]`` tables it serves (``shared.model_routes``); default:
            the modality's default model alone. Several share one
            :class:`~workers.models.model_set.ModelSet`.
    """

    def __init__(
        self,
        modality: str,
        settings: Settings,
        app: Celery,
        *,
        threaded: bool = True,
        models: Sequence[str] | None = None,
    ) -> None:
        cfg = settings.modality(modality)
        self.modality, self.cfg, self.settings, self.app = modality, cfg, settings, app
        self.models = list(models) if models else [cfg.model]
        self.runtime = DeviceRuntime(cfg.device, lanes=2 if cfg.batching.realtime_lane else 1)
        self.adapter = make_models(modality, settings, self.runtime, self.models)
        b = cfg.batching
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
                fair_share=settings.tenancy.share == "fair",
                tenant_weights=tuple((n, t.weight) for n, t in settings.tenants.items()),
                default_tenant=settings.tenancy.default_tenant,
            )
        )
        self.breaker = CircuitBreaker(cfg.circuit_threshold, cfg.circuit_cooldown_s)
        self.faults = RequestInjector(settings.debug.fault_injection)
        self.writer = ResultWriter(app, Waiter.of(settings))
        # a tenant's max_queued: its requests leave its set with their acks (none: no cost)
        self._release = (
            functools.partial(tenant_quota.release_commands, settings)
            if tenant_quota.limits(settings)
            else None
        )
        ttl = max(IN_FLIGHT_TTL_S, settings.redis.visibility_timeout_s * (MAX_DELIVERIES + 1))
        self.inflight = InFlight(app.backend.client, int(ttl), Waiter.of(settings))
        self.deliveries = Deliveries(self.inflight)
        self.isolation = Isolation()
        self.keeper: LeaseKeeper | None = None
        self.stats = EngineStats()
        self.events = TaskEvents()
        self.front_door = FrontDoor()  # a take's messages at once (batching_strategy)
        default = cfg.model if cfg.model in self.models else self.models[0]
        self.metrics = FleetMetrics(modality, model=default, queue_models=_queue_models(self))
        self.tracing = Tracing(settings, modality)
        self.ready = False
        self.warmup_later: dict[str, Any] = {}  # what _warmup left for the idle main lane
        self._by_id: dict[str, Work] = {}  # held or running, by task id (twins join these)
        self._arriving: dict[str, list[Any]] = {}  # arrived, not yet admitted -> its twins
        self._admitting: list[tuple[Any, TaskEnvelope]] = []
        self._threaded = threaded
        self._wire_parts()
        self._lock = self.lanes.lock  # guards what is held, too
        self._bind_gauges()

    def _wire_parts(self) -> None:
        """Admission, execution and completion, connected through this engine's state."""
        progress, obs = ProgressThrottle(), Observers(self.stats, self.metrics, self.tracing)
        self.loop = Loop()
        self.served = Served(self.modality, self.cfg.model, tuple(self.models))
        self.admission = Admission(
            self.adapter, self.deliveries, self.faults, self.tracing, self._worker_store
        )
        self.completer = Completer(self.writer, self, self.loop, obs, progress)
        self.handoff = Handoff(self.completer, self.loop, lambda: self.runtime.on_realtime_lane)
        self._host, self._batch_seq = socket.gethostname().split(".")[0], itertools.count(1)
        retry = RetryPolicy(self.cfg.max_retries, self.cfg.retry_backoff_s)
        self.runner = BatchRunner(
            self.modality,
            self.adapter,
            self.runtime,
            self,
            obs,
            breaker=self.breaker,
            retry=retry,
            latency=self.batcher.model,
            faults=self.faults,
            progress=progress,
            isolation=self.isolation,
            settled=self.handoff.wait_handled,
        )
        self.isolation.on_clear = self.handoff.wake  # admits what waited for a suspect
        self.handoff.on_drain = self._resume_admission
        self.lanes = Lanes(
            self.batcher, self.runtime, run=self.runner.run, crashed=self._crashed,
            expire=self._expire, warm_step=self._warm_step,
            idle_while_realtime=self.cfg.device.main_lane_idle_while_realtime,
        )  # fmt: skip

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Open the device, load the model, warm every bucket; then start the lanes."""
        self.runtime.start()
        t0 = time.perf_counter()
        self.adapter.load()
        load_s = time.perf_counter() - t0
        if self.runtime.lanes > 1:
            self.runtime.install_yield_points(self.adapter.torch_modules())
        self.runtime.warmup(self._warmup)
        if self._threaded:
            self._start_lanes()
        self.ready = True
        log.info(
            "engine ready modality=%s model=%s load_s=%.2f runtime=%s",
            self.modality,
            self.adapter.describe(),
            load_s,
            self.runtime.stats(),
        )

    def _start_lanes(self) -> None:
        self.lanes.start()
        window, size = self.cfg.device.prefetch_multiplier, self.cfg.batching.max_batch_size
        if window < size:
            log.warning(
                "prefetch window %d < max_batch_size %d: batches can never fill", window, size
            )

    def start_leases(self) -> None:
        """Start renewing the leases of every message this process holds (batch mode).

        Restore scans wait a lease period and the longest retry after Redis last refused
        a write, and a renewal period and that retry after this start
        (``workers.batching.refusals``): by then every live holder renewed, whatever it could
        not renew meanwhile."""
        from workers.consumer import lease

        r = self.settings.redis
        self.keeper = LeaseKeeper(lease_client(self.settings), r.lease_renew_s)
        keeper = self.keeper
        refusals.REFUSALS.held = lambda: len(keeper)
        longest = refusals.BACKOFF_S[-1]
        refusals.REFUSALS.configure(r.lease_s + longest, r.lease_renew_s + longest)
        lease.install(self.keeper)
        self.keeper.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Shut down gracefully: finish the running batch and what the window holds for up
        to ``timeout_s`` (default: the modality's ``soft_shutdown_timeout_s``), then give
        the rest back to its queue at once. Called on the worker's shutdown, after Celery
        stopped consuming; results and acks are then written from the inference thread."""
        timeout_s = self.cfg.soft_shutdown_timeout_s if timeout_s is None else timeout_s
        self._admit(block=True)  # what arrived last, then what the loop had not handled yet
        self.drain()
        with self._lock:
            self.loop.inline = True
            # Celery's event connection is closed by now: the inference thread must not
            # send events through it (progress, retried, started, succeeded).
            for w in self._by_id.values():
                for r in (w.req, *w.twins):
                    r.eventer = None
            self.lanes.wake_all()
        end = time.monotonic() + timeout_s
        while self._threaded and time.monotonic() < end and self.lanes.busy():
            time.sleep(0.05)
        self.lanes.stop(end)
        self._give_back_rest()
        self.deliveries.retire()  # a shutdown is not a death: no record of it stays
        if self.keeper is not None:
            self.keeper.stop()

    def _give_back_rest(self) -> None:
        """Return everything still held (unrun, or running past the shutdown timeout)."""
        with self._lock:
            works = list(self._by_id.values())
            self._by_id.clear()
        if not works:
            return
        running = sum(w.counted for w in works)
        self.deliveries.release(works)  # a shutdown is not a death: out of the records
        self._give_back([r for w in works for r in (w.req, *w.twins)])
        log.info("shutdown: gave back %d requests (%d were running)", len(works), running)

    def give_back_unsettled(self, done: list[Done]) -> None:
        """Return requests whose result or ack Redis kept refusing (``CompletionHost``)."""
        reqs = []
        for d in done:
            with self._lock:
                self._by_id.pop(d.req.id, None)
            reqs += [d.req, *(d.work.twins if d.work else ())]
        self.deliveries.release([d.work for d in done if d.work])
        self._give_back(reqs)

    def _give_back(self, reqs: list[Any]) -> None:
        """Return messages to their queues at once, unrun (``workers.consumer.lease.give_back``)."""
        self.stats.given_back += give_back(reqs, self.keeper, self.tracing)

    def attach(self, hub: Any) -> None:
        """Complete requests on the consumer's event loop (``hub``), or inline if ``None``."""
        if hub is None:
            self.loop.inline = True
            return
        self.handoff.attach(hub)

    def drain(self) -> None:
        """Handle everything the inference threads posted (event-loop thread)."""
        self.handoff.drain()

    def _warmup(self) -> None:
        """Warm the buckets the worker needs before ready; queue the rest for the idle main
        thread (see :mod:`workers.batching.batcher`; every bucket without an inference thread)."""
        pol = self.batcher.policy

        def largest(bucket: str | None) -> int:
            one = self.adapter.example_inputs(1, bucket)[0]
            per_request = max(self.adapter.prepare(one).nbytes, 1)
            return min(pol.max_batch_size, pol.max_batch_bytes // per_request)

        plan = warm_plan(self.adapter.buckets(), largest)
        before = self.cfg.batching.warmup_buckets_before_ready if self._threaded else None
        first, rest = split_plan(plan, before)
        runs = [self._warm_step(step) for step in first]
        pays = warming_pays(runs)
        # Logged with the worker's ready line (Celery's logging is not set up yet here).
        self.warmup_later = {
            "steps": len(rest),
            "queued": pays,
            "first_second_s": [[round(a, 4), round(b, 4)] for a, b in runs],
        }
        if not pays:
            rest = []
        self.lanes.warm_later = WarmQueue(rest)

    def _warm_step(self, step: WarmStep) -> tuple[float, float]:
        """Run ``step`` twice; observe the second run; ``(first_s, second_s)``."""
        inputs = self.adapter.example_inputs(step.n, step.bucket)
        samples = [self.adapter.preprocess(self.adapter.prepare(i)) for i in inputs]
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            with self.runtime.batch_context():
                results = self.adapter.run_batch(samples)
            times.append(time.perf_counter() - t0)
            self.adapter.discard(results)  # no client reads a warmup's outputs
        self.batcher.model.observe(step.bucket, step.n, times[1])
        return times[0], times[1]

    def run_one(self, request: dict[str, Any]) -> dict[str, Any]:
        """Run one request alone, in the calling thread (baseline mode: plain Celery).

        Raises:
            FleetError: bad input (with its code), an expired deadline, or a model fault.
        """
        env = screen((), {"request": request}, self.served)
        if isinstance(env, Refusal):
            raise env.error
        return self.runner.run_alone(env.inputs, env.model)

    # -- loop thread: arrivals ----------------------------------------------------------
    def on_request(self, req: Any) -> None:
        """A message entered the prefetch window (event-loop thread).

        Cheap checks run here; decoding waits for :meth:`_admit`, which first records the
        fetch's messages as being decoded (one round trip for every message of a fetch), so
        that a message whose decoding kills the worker is blamed like one that kills it in a
        batch."""
        self.stats.received += 1
        self.metrics.eco.received(self.metrics.eco.queue_of(req))
        self.tracing.arrived(req)
        worker_state.task_reserved(req)
        env = screen(req.args, req.kwargs, self.served)
        with self._lock:
            if self._join_twin(req):
                return
            if not isinstance(env, Refusal):
                self._arriving[req.id] = []
        if isinstance(env, Refusal):
            self.completer.refuse(req, env.error, env.priority)
            return
        self._admitting.append((req, env))
        if self.loop.running:
            if len(self._admitting) == 1:  # after the rest of this fetch's messages
                self.loop.hub.call_soon(self._admit)
        else:
            self._admit()

    def _join_twin(self, req: Any) -> bool:
        """A copy of a task id held already runs once, with the first copy (under the
        lock)."""
        first = self._by_id.get(req.id)
        twins = first.twins if first is not None else self._arriving.get(req.id)
        if twins is None:
            return False
        twins.append(req)
        self.stats.twins += 1
        return True

    def _admit(self, block: bool = False) -> None:
        """Record the messages that arrived as being decoded (counting the deaths of the
        redelivered ones), decode them, take them out of the decode record, and only then hold
        them for the batcher: none of a group runs while its group-mates are still recorded
        (``workers.batching.admission``). Suspects (a worker died with them before) are decoded
        one at a time, each recorded alone, so a decoder one of them kills blames no group-mate.

        While a suspect runs (or waits to) the arrivals wait unread, unless ``block``."""
        if not self._admitting:
            return
        if not self.isolation.try_admit(block=block or not self.loop.running):
            return  # admitted by _resume_admission once the suspect ends
        try:
            batch, self._admitting = self._admitting, []
            counts = self.deliveries.arrive(
                [req.id for req, _ in batch], [redelivered(req) for req, _ in batch]
            )
            suspects = [m for m, c in zip(batch, counts, strict=True) if self.deliveries.suspect(c)]
            if suspects:  # not recorded while the others decode; each again, alone, below
                self.deliveries.decoded([req.id for req, _ in suspects])
            held = self._decode_counted(
                [
                    (m, c)
                    for m, c in zip(batch, counts, strict=True)
                    if not self.deliveries.suspect(c)
                ]
            )
            for m in suspects:
                [count] = self.deliveries.arrive([m[0].id], [True])
                held += self._decode_counted([(m, count)])
        finally:
            self.isolation.admitted()
        with self._lock:
            for pending in held:
                self._by_id[pending.id] = pending.item
                self.lanes.hold(pending)

    def _decode_counted(self, items: list[tuple[tuple[Any, TaskEnvelope], int]]) -> list[Pending]:
        """Decode arrivals (each with its count); then take them out of the decode record
        (held or refused, none is being decoded any more); what to hold."""
        held: list[Pending] = []
        with self._lock:  # their twins: no copy joins them once decoding starts
            arriving = self._arriving
            all_twins = [arriving.pop(req.id, []) for (req, _), _ in items]
        for ((req, env), count), twins in zip(items, all_twins, strict=True):
            pending = self._decode(req, env, count, twins)
            if pending is not None:
                held.append(pending)
        self.deliveries.decoded([req.id for (req, _), _ in items])
        return held

    def _resume_admission(self) -> None:
        """Admit what waited while a suspect ran (loop thread, after each drain)."""
        if self._admitting:
            self._admit()

    def _decode(self, req: Any, env: TaskEnvelope, count: int, twins: list[Any]) -> Pending | None:
        """Admit one request (decode it); ``None`` if it was refused (settled here)."""
        pending = self.admission.admit(req, env, count, twins)
        if isinstance(pending, FleetError):
            for r in (req, *twins):
                self.completer.refuse(r, pending, env.priority)
            return None
        return pending

    def _worker_store(self) -> Any:
        from shared.transport import process_store

        return process_store(self.settings, role="worker")

    def refuse(self, req: Any, exc: FleetError) -> None:
        """Fail a request at arrival with ``exc`` (stored first-wins, then acked)."""
        self.completer.refuse(req, exc)

    def refuse_message(self, message: Any, exc: Exception) -> None:
        """A message no request could be built from (see ``Completer.refuse_message``)."""
        self.stats.received += 1
        self.completer.refuse_message(message, exc)

    # -- the parts' host (workers.batching.execution.RunnerHost,
    # workers.batching.completion.CompletionHost) --
    def post(self, items: Sequence[Posted]) -> None:
        self.handoff.post(items)

    def schedule(self, pending: Pending) -> None:
        self.lanes.schedule(pending)

    def new_batch_id(self) -> str:
        return f"{self._host}-{os.getpid()}-{next(self._batch_seq)}"  # next() is atomic

    def ack(self, reqs: list[Any]) -> int:
        return ack_batch(reqs, self.keeper, self._release)

    def plan_acks(self, reqs: list[Any]) -> AckPlan:
        return plan_acks(reqs, self.keeper, self._release)

    @staticmethod
    def task_ready(reqs: Sequence[Any]) -> None:
        """Celery's ``worker_state.task_ready(req)`` for each of ``reqs`` (``successful`` left
        unset, as the engine has always called it), in one go: each id out of ``requests``,
        the requests out of the ``active``, ``reserved`` and ``scheduled`` sets (a set with
        nothing in it is left alone: no request to drop)."""
        pop = worker_state.requests.pop
        for req in reqs:
            pop(req.id, None)
        for held in (
            worker_state.active_requests,
            worker_state.reserved_requests,
            worker_state.scheduled_requests,
        ):
            if held:
                held.difference_update(reqs)

    @staticmethod
    def task_accepted(reqs: Sequence[Any]) -> None:
        """Celery's ``worker_state.task_accepted`` for each of ``reqs``, in one go: each in
        ``requests`` and the ``active`` set, the per-name and overall total counts raised once
        per name (not a ``Counter.update`` per request)."""
        requests = worker_state.requests
        for req in reqs:
            requests[req.id] = req
        worker_state.active_requests.update(reqs)
        names = [req.name for req in reqs]
        total = worker_state.total_count
        for name in dict.fromkeys(names):
            total[name] += names.count(name)
        worker_state.all_total_count[0] += len(reqs)

    def accepted(self, reqs: list[Any]) -> None:
        """What ``Request.on_accepted`` does for each (pid and start time on the request,
        Celery's ``task_accepted`` bookkeeping, the ``task-started`` event), the bookkeeping
        done and the events sent as one group. A request Celery's own hook must see (not
        ``acks_late``, or a terminate asked before it started) goes through
        ``on_accepted``."""
        pid, now = os.getpid(), time.time()
        started: list[Any] = []
        for req in reqs:
            if not req.task.acks_late or req._terminate_on_ack is not None:
                req.on_accepted(pid, time.monotonic())
                continue
            req.worker_pid, req.time_start = pid, now
            started.append(req)
        self.task_accepted(started)
        self.events.send("task-started", [(req, {}) for req in started])

    def send_events(self, type_: str, items: Sequence[tuple[Any, dict[str, Any]]]) -> None:
        self.events.send(type_, items)

    def forget(self, done: Sequence[Done]) -> None:
        by_id = self._by_id
        with self._lock:
            for d in done:
                if d.work is not None and by_id.get(d.req.id) is d.work:
                    del by_id[d.req.id]

    # -- lane threads -----------------------------------------------------------------
    def _crashed(self, batch: list[Pending]) -> None:
        err = ModelError("batch crashed")
        self.post([Done(p.item, p.item.req, Outcome(p.id, error=err)) for p in batch])

    def _expire(self, expired: list[Pending]) -> None:
        self.stats.expired += len(expired)
        err = DeadlineExceeded("deadline passed before it could run")
        self.post([Done(p.item, p.item.req, Outcome(p.id, error=err)) for p in expired])

    def gate(self, batch: list[Work]) -> list[Work]:
        """The members to run: revoked ones end ``REVOKED``, ones with a final result are
        acked unrun; the lane's blame record names the others."""
        revoked = worker_state.revoked
        gone = [w for w in batch if w.req.id in revoked]
        if gone:
            self.stats.revoked += len(gone)
            err = Revoked("revoked before it ran")
            # Celery's revoke command stored REVOKED already (it does for reserved requests):
            # that document stands; ours is written only if it is missing.
            outs = [Outcome(w.req.id, error=err, keep_existing=True) for w in gone]
            self.post([Done(w, w.req, o) for w, o in zip(gone, outs, strict=True)])
            batch = [w for w in batch if w.req.id not in revoked]
        run, dups = self.deliveries.begin(batch)
        if dups:
            self.stats.duplicates += len(dups)
            self.post([Done(w, w.req, Outcome(w.req.id), duplicate=True) for w in dups])
        self.lanes.mark_running(run)
        return run

    # -- introspection (workers.consumer.stats) ----------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """JSON-able stats for the ``fleet_stats`` control command and metrics."""
        return stats.snapshot(self)

    def _bind_gauges(self) -> None:
        """Point-in-time gauges, read at scrape time."""
        stats.bind_gauges(self)


class TaskEvents:
    """Task events of many requests at once, into Celery's event buffer.

    The same events ``Request.send_event`` sends (Celery's ``EventDispatcher.send`` with the
    ``task`` group buffered, as a worker on an event loop has it): the fields the caller
    gives, ``uuid``, the dispatcher's ``hostname``, ``pid`` and a tick of its logical
    ``clock``, ``utcoffset``, ``timestamp`` and ``type``. What Celery computes per event (the
    UTC offset from ``localtime()``, the keyword plumbing of ``Event()``) is done once per
    call; the buffer is flushed as Celery's own send does (at ``buffer_limit``, else through
    ``on_send_buffered``: ``coalesce_task_events``). A dispatcher that does not buffer the
    ``task`` group, or a request with another dispatcher, gets Celery's own ``send_event``.
    """

    OFFSET_TTL_S = 60.0  # the UTC offset changes twice a year: read it once a minute

    def __init__(self) -> None:
        self._offset: tuple[float, float] = (-1e9, 0.0)  # (read at, offset)
        self._received: list[tuple[Any, dict[str, Any]]] = []  # defer_received

    def _utcoffset(self, now: float) -> float:
        at, offset = self._offset
        if now - at > self.OFFSET_TTL_S:
            offset = celery_utcoffset()
            self._offset = (now, offset)
        return offset

    def defer_received(self, req: Any, fields: dict[str, Any], hub: Any) -> None:
        """A ``task-received`` event, stamped now and sent with the other arrivals of this
        loop turn (``hub.call_soon``; at once without a hub). Any other event sent first
        sends these before it: a request's events keep their order."""
        self._received.append((req, {**fields, "timestamp": time.time()}))
        if hub is None:
            self.flush_received()
        elif len(self._received) == 1:
            hub.call_soon(self.flush_received)

    def flush_received(self) -> None:
        if self._received:
            received, self._received = self._received, []
            self._send("task-received", received)

    def send(self, type_: str, items: Sequence[tuple[Any, dict[str, Any]]]) -> None:
        """``req.send_event(type_, **fields)`` for each ``(req, fields)`` of ``items``
        (a ``timestamp`` among the fields is the event's own; else it is stamped now)."""
        self.flush_received()
        self._send(type_, items)

    def _send(self, type_: str, items: Sequence[tuple[Any, dict[str, Any]]]) -> None:
        if not items:
            return
        d = getattr(items[0][0], "_eventer", None)
        buffers = getattr(d, "_group_buffer", None)
        if (
            d is None
            or not d.enabled
            or buffers is None
            or "task" not in (d.buffer_group or ())
            or (d.groups and "task" not in d.groups)
        ):
            for req, fields in items:
                req.send_event(type_, **fields)
            return
        now = time.time()
        base = {"hostname": d.hostname, "utcoffset": self._utcoffset(now), "pid": d.pid}
        clock = d.clock
        with clock.mutex:  # the group's ticks at once: LamportClock.forward, len(items) times
            tick = clock.value
            clock.value += len(items)
        buf = buffers["task"]
        for req, fields in items:
            tick += 1
            if req._eventer is not d or not req.task.send_events:
                req.send_event(type_, **fields)
                continue
            event = {**base, "clock": tick, "uuid": req.id, "timestamp": now, **fields}
            event["type"] = type_
            buf.append(event)
        if len(buf) >= d.buffer_limit:
            d.flush()
        elif d.on_send_buffered:
            d.on_send_buffered()


def batching_strategy(task: Any, app: Any, consumer: Any, **_: Any) -> Callable[..., None]:
    """Return the message handler Celery calls per received message of ``task``."""
    engine = current()
    engine.attach(consumer.hub)
    hostname = consumer.hostname
    eventer = consumer.event_dispatcher
    ev = engine.settings.events
    coalesce_task_events(eventer, consumer.hub, ev.flush_interval_ms, ev.buffer_limit)
    send_events = bool(eventer and eventer.enabled and task.send_events)
    Req = create_request_cls(
        symbol_by_name(task.Request), task, consumer.pool, hostname, eventer, app=app
    )
    revoked = consumer.controller.state.revoked
    build = _request_builder(Req, task, app, consumer, eventer)
    events, loop = engine.events, engine.loop

    def handler(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **__: Any) -> None:
        arrive(message, body, ack, reject)

    def arrive(message: Any, body: Any, ack: Any, reject: Any) -> None:
        try:
            req = build(message, body, ack, reject)
        except Exception as exc:  # a malformed message: fail it, never the consumer
            engine.refuse_message(message, exc)
            return
        if (req.expires or req.id in revoked) and req.revoked():
            return
        if send_events:
            events.defer_received(
                req,
                {
                    "name": req.name,
                    "args": req.argsrepr,
                    "kwargs": req.kwargsrepr,
                    "root_id": req.root_id,
                    "parent_id": req.parent_id,
                    "retries": req.request_dict.get("retries", 0),
                },
                loop.hub if loop.running else None,
            )
        if req.eta:
            engine.refuse(req, EtaNotSupported("ETA/countdown is not supported; submit when due"))
            return
        engine.on_request(req)

    engine.front_door.serve(task.name, arrive, consumer)
    return handler


Arrive = Callable[[Any, Any, Any, Any], None]  # (message, body, ack, reject)


class FrontDoor:
    """Hands each message of a take to the arrival of its task's strategy."""

    def __init__(self) -> None:
        self._arrivals: dict[str, Arrive] = {}
        self._consumer: Any = None

    def serve(self, task_name: str, arrive: Arrive, consumer: Any) -> None:
        """Take ``task_name``'s messages to ``arrive`` (its strategy's, built by ``consumer``:
        Celery builds the strategies again when its consumer restarts)."""
        self._arrivals[task_name] = arrive
        self._consumer = consumer

    def receive(self, group: list[tuple[Any, Callable[[Any], Any]]]) -> None:
        """Each ``(message, callback)`` of a take, in order (the channel's receiver)."""
        c = self._consumer
        arrivals = self._arrivals
        if c is None or self._restoring(c):
            for message, callback in group:
                callback(message)
            return
        soon = c.call_soon_ack
        partial = functools.partial
        for message, callback in group:
            arrive = None
            if message._decoded_cache is not None and not message.errors:
                headers = message.headers
                if type(headers) is dict:
                    arrive = arrivals.get(headers.get("task"))
            if arrive is None:
                callback(message)
                continue
            try:
                arrive(
                    message,
                    None,
                    partial(soon, message.ack_log_error),
                    partial(soon, message.reject_log_error),
                )
            except (InvalidTaskError, ContentDisallowed) as exc:
                c.on_invalid_task(None, message, exc)
            except DecodeError as exc:
                c.on_decode_error(message, exc)

    @staticmethod
    def _restoring(c: Any) -> bool:
        """Whether Celery restores its prefetch count as acks come (after a restart)."""
        return (
            not c._maximum_prefetch_restored
            and c.restart_count > 0
            and c._new_prefetch_count <= c.max_prefetch_count
        )


def _request_builder(
    Req: Any, task: Any, app: Any, consumer: Any, eventer: Any
) -> Callable[[Any, Any, Any, Any], Any]:
    """``build(message, body, ack, reject)``: the message as a ``Req`` (protocol 1 and
    hybrid bodies converted to protocol 2), checked by :func:`_check_shape`."""
    hostname = consumer.hostname

    def build(message: Any, body: Any, ack: Any, reject: Any) -> Any:
        if body is None and "args" not in message.payload:
            body, headers, decoded, utc = (message.body, message.headers, False, True)
        elif "args" in message.payload:
            body, headers, decoded, utc = hybrid_to_proto2(message, message.payload)
        else:
            body, headers, decoded, utc = proto1_to_proto2(message, body)
        req = Req(
            message,
            on_ack=ack,
            on_reject=reject,
            app=app,
            hostname=hostname,
            eventer=eventer,
            task=task,
            connection_errors=consumer.connection_errors,
            body=body,
            headers=headers,
            decoded=decoded,
            utc=utc,
        )
        _check_shape(req)
        return req

    return build


def _check_shape(req: Any) -> None:
    """Touch what the engine reads, so a malformed message fails here, not later.

    Raises:
        InvalidMessage: the id, args or kwargs are not what Celery's protocol 2 sends.
    """
    if not isinstance(req.id, str) or not req.id:
        raise InvalidMessage("the message has no task id")
    if not isinstance(req.args, list | tuple) or not isinstance(req.kwargs, dict):
        raise InvalidMessage("the body is not [args, kwargs, embed]")
    _ = req.eta, req.expires, req.delivery_info  # parsed lazily by Celery: may raise


def coalesce_task_events(
    dispatcher: Any, hub: Any, flush_interval_ms: float, buffer_limit: int
) -> bool:
    """Make ``dispatcher`` (Celery's ``EventDispatcher``) flush buffered task events at most
    every ``flush_interval_ms`` on ``hub`` (the consumer's kombu event loop).

    Returns:
        False, changing nothing, without a hub or an enabled dispatcher, or with an interval
        of 0 (Celery's own behaviour: a flush every loop turn).
    """
    if hub is None or dispatcher is None or not dispatcher.enabled or flush_interval_ms <= 0:
        return False
    delay_s = flush_interval_ms / 1000.0
    pending = False

    def flush() -> None:
        nonlocal pending
        pending = False
        dispatcher.flush()

    def schedule() -> None:
        nonlocal pending
        if not pending:
            pending = True
            hub.call_later(delay_s, flush)

    dispatcher.buffer_limit = buffer_limit
    dispatcher.on_send_buffered = schedule
    return True


_engine: Engine | None = None


def install(engine: Engine) -> None:
    global _engine
    _engine = engine


def current() -> Engine:
    """The started engine.

    Raises:
        RuntimeError: no engine was started in this process (not a fleet worker).
    """
    if _engine is None:
        raise RuntimeError("no batching engine in this process; start it with `fleet worker`")
    return _engine
