"""Jobs: one inference request of the gateway, from admission to its final result.

A job is a fleet task whose id is the OIP request ``id``, the ``Idempotency-Key`` header, or
a fresh UUID. Its document ``fleet:job:<id>`` (JSON: model, modality, priority, times, the
/dev/shm segments of its input, the request's fingerprint) is written in the same transaction
as the task's message, only if the id has none (``producer.gateway.commit``: a crash leaves
both or neither), so a repeated POST with the same id finds it and never publishes again (a
different request with that id is refused ``ID_CONFLICT``: :func:`same_request`,
``producer.gateway.fingerprint``); every gateway process
shares it through Redis (no other state). Its state is Celery's result document
(``celery-task-meta-<id>``): absent = ``PENDING`` (queued), ``PROGRESS`` (a video's
done/total frames), then one final ``SUCCESS`` / ``FAILURE`` / ``REVOKED``.

The producer API is one ``producer.client.AsyncFleetClient`` (its ``redis.asyncio`` pool,
its message builder, its result subscriptions): validation and envelopes
(``client.envelope``), the message (``client.message``, the bytes ``submit`` sends), worker
liveness and queue depths (``client.live_workers``, ``client.queue_depth``; cached and
shared here), cancelling (``client.cancel``, on the event loop), the /dev/shm inputs and
results (``client.video_inputs``, ``release_inputs``, ``resolve``) and waiting
(``producer.gateway.waiter``, on ``client.subscriptions``). What the client does not do is
the job: its record and message written together, once per id (``producer.gateway.commit``,
on the client's connections), and admission (``producer.gateway.admission``).

A new job costs three round trips: ``WATCH`` and ``GET`` of its document (the LLENs
admission needs beside them, on another connection), then ``MULTI``/``SET``/``LPUSH``/``EXEC``
of the document and its message. Blocking work (/dev/shm writes and reads, large inputs'
encoding) runs on a small thread pool, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from producer.client import AsyncFleetClient
from producer.gateway import crashpoints
from producer.gateway.admission import (
    RateMeter,
    SentJobs,
    ahead_of,
    deadline_refusal,
    meter_queue,
    queue_full,
    queue_of,
)
from producer.gateway.commit import Attempt, commit, commit_waiting
from producer.gateway.errors import IdConflict
from producer.gateway.fingerprint import request_fingerprint
from producer.gateway.models import ModelSpec, fleet_inputs
from producer.gateway.waiter import FINAL_STATES, ResultWatch, decode_meta, final_document
from shared import schema
from shared.errors import (
    DeadlineUnreachable,
    FleetError,
    NoReadyWorker,
    QueueFull,
    error_from_wire,
    is_error_wire,
)
from shared.redis_refusal import BROKER_FAULTS, broker_unavailable
from shared.schema import Priority, TaskEnvelope
from shared.tensor_wire import SHM, iter_wires

log = logging.getLogger("fleet.gateway")
WAIT_GRACE_S = 0.25  # a result stored right at the deadline still makes the sync answer
LARGE_INPUT_BYTES = 64 * 1024  # inputs this large are encoded off the event loop
DEPTH_SAMPLE_S = 0.5


@dataclass(slots=True)
class Job:
    """The job document (``fleet:job:<id>``)."""

    id: str
    model: str
    modality: str
    priority: str
    created_ms: float
    deadline_ms: float | None
    input_refs: list[dict[str, Any]] = field(default_factory=list)
    # the request's content (``producer.gateway.fingerprint``); None in records written
    # before it was kept: any request with their id is taken for the same one
    fingerprint: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Job | None:
        try:
            d = json.loads(raw)
            return cls(**d)
        except (ValueError, TypeError):
            return None


@dataclass(slots=True)
class Snapshot:
    """A job and its state right now: ``meta`` is its result document (``None``: queued)."""

    job: Job
    meta: dict[str, Any] | None

    @property
    def state(self) -> str:
        return "PENDING" if self.meta is None else str(self.meta.get("status", "PENDING"))

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def progress(self) -> dict[str, Any] | None:
        if self.meta is not None and self.meta.get("status") == "PROGRESS":
            r = self.meta.get("result")
            return r if isinstance(r, dict) else None
        return None


def same_request(existing: Job, model: str, fingerprint: str) -> Job:
    """``existing``, the job a POST's id names, if that POST is the same request (its
    model, and its fingerprint when the record keeps one).

    Raises:
        IdConflict: the id names a job of another model, or of different content.
    """
    if existing.model != model:
        raise IdConflict(f"id {existing.id!r} already names a job of model {existing.model!r}")
    if existing.fingerprint is not None and existing.fingerprint != fingerprint:
        raise IdConflict(
            f"id {existing.id!r} is in use by a different request (other inputs or "
            "parameters) to this model; send a fresh id, or omit the id (and "
            "Idempotency-Key) to get one; repeat an id only to retry the same request"
        )
    return existing


def error_of(meta: dict[str, Any]) -> tuple[str, str]:
    """``(code, message)`` of a FAILURE / REVOKED result document."""
    res = meta.get("result")
    if is_error_wire(res):
        code, message, exc_type = error_from_wire(res)
        if code is None:
            code = "REVOKED" if meta.get("status") == "REVOKED" else "FLEET_ERROR"
        return code, exc_type if message is None else message
    if meta.get("status") == "REVOKED":
        return "REVOKED", "revoked before it ran"
    return "FLEET_ERROR", f"task ended {meta.get('status')}"


class JobService:
    """Submits, watches and cancels jobs for one gateway process.

    Args:
        client: the producer API (envelopes, messages, liveness, queue depths, cancel,
            /dev/shm, result subscriptions); its ``redis`` carries the job commits and reads.
        models: the served models.

    :meth:`stop` does not close ``client`` (its owner does).
    """

    def __init__(self, client: AsyncFleetClient, models: dict[str, ModelSpec]) -> None:
        self.client = client
        self.settings = client.settings
        self.gw = client.settings.gateway
        self.redis = client.redis
        self.models = models
        self.pool = ThreadPoolExecutor(self.gw.publish_threads, thread_name_prefix="gw-io")
        self.meters: dict[str, RateMeter] = {}
        self._sent = SentJobs()  # task id -> its queue, for jobs sent here
        self._live: dict[str, tuple[float, list[str]]] = {}
        self._inflight: dict[str, asyncio.Future[Any]] = {}
        self._sampler: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sampler = asyncio.create_task(self._sample_depths(), name="gateway-depth-sampler")

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._sampler
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def _sample_depths(self) -> None:
        """Every ``DEPTH_SAMPLE_S``, the depth of each modality whose queues this process
        waited on within the admission window (the rate meters need to know whether their
        queue stayed backlogged while completions came in)."""
        while True:
            await asyncio.sleep(DEPTH_SAMPLE_S)
            now = time.monotonic()
            active = {
                meter_queue(q)
                for q, m in self.meters.items()
                if now - m.last_activity < self.gw.admission_window_s
            }
            for modality, model in active:
                with contextlib.suppress(Exception):
                    await self._depth_now(modality, model)

    async def _io(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def _single_flight(self, key: str, make: Any) -> Any:
        """One read of ``key`` at a time; concurrent callers share its answer."""
        fut = self._inflight.get(key)
        if fut is None:
            fut = asyncio.ensure_future(make())
            self._inflight[key] = fut
            fut.add_done_callback(lambda _f: self._inflight.pop(key, None))
        return await asyncio.shield(fut)

    # -- readiness and queue depth --------------------------------------------------------
    async def live_workers(self, modality: str, model: str | None = None) -> list[str]:
        """Live worker nodes of ``modality`` (``model``: those serving that table;
        ``AsyncFleetClient.live_workers``, cached ``live_cache_s``; concurrent callers share
        one read). The client samples Redis' clock there when due: the submit times and
        deadlines of envelopes count from it.

        Raises:
            BrokerUnavailable: Redis could not be asked.
        """
        now = time.monotonic()
        key = modality if model is None else f"{modality}@{model}"
        hit = self._live.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]

        async def read() -> list[str]:
            try:
                nodes = await self.client.live_workers(modality, model)
            except BROKER_FAULTS as exc:  # the client's own are BrokerUnavailable already
                raise broker_unavailable(exc, "cannot read worker liveness") from None
            self._live[key] = (time.monotonic() + self.gw.live_cache_s, nodes)
            return nodes

        return await self._single_flight(f"live:{key}", read)

    async def _depth_now(self, modality: str, model: str | None = None) -> dict[str, int]:
        """Requests waiting in Redis per class, read now (``AsyncFleetClient.queue_depth``:
        admission judges the depth as of this request), and observed by the rate meters.

        Raises:
            BrokerUnavailable: Redis did not answer.
        """
        try:
            depth = await self.client.queue_depth(modality, model)
        except BROKER_FAULTS as exc:  # the client's own are BrokerUnavailable already
            raise broker_unavailable(exc, "cannot read the queue depth") from None
        now = time.monotonic()
        self.meter(queue_of(modality, "realtime", model)).observe_depth(now, depth["realtime"])
        main = sum(v for k, v in depth.items() if k != "realtime")
        self.meter(queue_of(modality, "normal", model)).observe_depth(now, main)
        return depth

    def meter(self, queue: str) -> RateMeter:
        m = self.meters.get(queue)
        if m is None:
            m = self.meters[queue] = RateMeter(
                self.gw.admission_window_s, self.gw.admission_min_samples
            )
        return m

    def _on_final(self, task_id: str) -> None:
        """A job's final result was read by a wait: a completion for its queue's meter (once:
        jobs sent by this process only)."""
        queue = self._sent.observed(task_id)
        if queue is not None:
            self.meter(queue).observe_completion(time.monotonic())

    async def _require_live(self, spec: ModelSpec) -> None:
        """Raises NoReadyWorker when no live worker serves ``spec``'s modality."""
        if not await self.live_workers(spec.modality, spec.live_model):
            raise NoReadyWorker(
                f"no live {spec.modality} worker serves model {spec.name!r} "
                f"(version {spec.version})",
            )

    def _admit(
        self, spec: ModelSpec, priority: str, timeout_s: float | None, depth: dict[str, int]
    ) -> None:
        """Raises QueueFull or DeadlineUnreachable for the queue ``depth`` just read (see
        ``admission``)."""
        full = queue_full(
            self.settings.modalities.get(spec.modality), depth, spec.modality, priority
        )
        if full:
            raise QueueFull(full)
        if not self.gw.admission:
            return
        ahead = ahead_of(priority, depth)
        meter = self.meter(queue_of(spec.modality, priority, spec.route_model))
        now = time.monotonic()
        if timeout_s is None:
            timeout_s = Priority.parse(priority).default_timeout_s(self.settings)
        refusal = deadline_refusal(ahead, meter.rate(now), timeout_s, self.gw.admission_safety)
        if refusal is not None:
            err = DeadlineUnreachable(refusal.message)
            err.retry_after_s = refusal.retry_after_s  # type: ignore[attr-defined]
            raise err

    # -- submitting -----------------------------------------------------------------------
    async def get_job(self, task_id: str) -> Job | None:
        raw = await self.redis.get(schema.job_key(task_id))
        return None if raw is None else Job.from_json(raw)

    async def submit(
        self,
        spec: ModelSpec,
        tensors: list[Any],
        priority: str,
        timeout_s: float | None,
        task_id: str | None,
        body_bytes: int = 0,
        parameters: dict[str, Any] | None = None,
        tenant: str | None = None,
    ) -> tuple[Job, bool]:
        """Admit and publish a request; returns ``(job, created)``. ``created`` is False when
        ``task_id`` named an existing job of the same request (:func:`same_request`): that
        job is returned and nothing is sent.

        Raises:
            FleetError: invalid input (400s), ``NoReadyWorker``, ``QueueFull``,
                ``DeadlineUnreachable``, ``TenantQuota`` (``tenant``'s ``max_queued``:
                ``producer.gateway.commit``), ``BrokerUnavailable``; ``IdConflict``: ``task_id``
                names a job of another model or of a different request.
        """
        inputs, video, fingerprint = await self._decoded(spec, tensors, body_bytes, parameters)
        if task_id is not None and video is not None:
            # before the video is written to /dev/shm for nothing
            existing = await self.get_job(task_id)
            if existing is not None:
                return same_request(existing, spec.key, fingerprint), False
        task_id = task_id or str(uuid.uuid4())
        await self._require_live(spec)
        if video is not None:
            # bound to this request: renewed while it waits (shared.transport.lifetime)
            options = inputs  # the request's options (top_k), beside the video's input
            inputs = await self._io(self.client.video_inputs, video, None, task_id)
            inputs = {**inputs, **options}
        await crashpoints.pause("inputs-written", task_id)
        refs = list(iter_wires(inputs, SHM))
        attempt: Attempt | None = None
        try:
            env = await self._envelope(spec, inputs, priority, timeout_s, body_bytes)
            if tenant is not None:
                env = env.model_copy(update={"tenant": tenant})
            job = Job(
                task_id,
                spec.key,
                spec.modality,
                env.priority,
                env.submitted_ms,
                env.deadline_ms,
                refs,
                fingerprint,
            )
            ttl = int(self.settings.redis.result_expires_s)
            message = self.client.message(env, task_id)
            attempt = Attempt(task_id, schema.job_key(task_id), job.to_json(), ttl, message)

            async def admit() -> None:
                depth = await self._depth_now(job.modality, spec.route_model)
                self._admit(spec, env.priority, timeout_s, depth)

            found = await self._create(attempt, admit)
        except BaseException:
            if attempt is None or not attempt.maybe_sent:  # else the message may name them
                await self._release(refs)
            raise
        if found is not None:  # another POST with this id made the job: that one is the job
            await self._release(refs)
            existing = Job.from_json(found)
            if existing is None:
                raise FleetError(f"job {task_id} has an unreadable record")
            return same_request(existing, spec.key, fingerprint), False
        await crashpoints.pause("after-push", task_id)
        self._sent.sent(task_id, queue_of(spec.modality, env.priority, spec.route_model))
        return job, True

    async def _decoded(
        self,
        spec: ModelSpec,
        tensors: list[Any],
        body_bytes: int,
        parameters: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Any], bytes | None, str]:
        """``fleet_inputs`` of the request and its fingerprint, off the event loop for a
        large body."""

        def decode() -> tuple[dict[str, Any], bytes | None, str]:
            inputs, video = fleet_inputs(spec, tensors, parameters)
            return inputs, video, request_fingerprint(spec.key, inputs, video)

        if body_bytes > LARGE_INPUT_BYTES:
            decoded: tuple[dict[str, Any], bytes | None, str] = await self._io(decode)
            return decoded
        return decode()

    async def _envelope(
        self,
        spec: ModelSpec,
        inputs: dict[str, Any],
        priority: str,
        timeout_s: float | None,
        body_bytes: int,
    ) -> TaskEnvelope:
        """The request's envelope for ``spec``'s model, off the event loop for a large body.

        Raises:
            FleetError: invalid input (the client's checks).
        """
        env: TaskEnvelope
        if body_bytes > LARGE_INPUT_BYTES:
            env = await self._io(self.client.envelope, spec.modality, inputs, priority, timeout_s)
        else:
            env = self.client.envelope(spec.modality, inputs, priority, timeout_s)
        return env.model_copy(update={"model": spec.key})

    async def _create(self, attempt: Attempt, admit: Callable[[], Awaitable[None]]) -> bytes | None:
        """The job's record and message in one transaction, unless its id has a record
        (``producer.gateway.commit``: why, and every crash point). ``admit`` judges the
        queue first. On the client's ``redis.asyncio`` connections; behind Sentinel
        (``wait_replicas``) the transaction is followed by ``WAIT`` on its connection, on a
        worker thread through the client's Celery app (as ``AsyncFleetClient`` publishes
        there), retried through a failover (a write on the old primary, unreplicated, would
        be lost with it). Returns ``None`` when this call made the job, else the record found.

        Raises:
            QueueFull, DeadlineUnreachable: ``admit`` refused it (nothing written).
            BrokerUnavailable: Redis did not take it (``attempt.maybe_sent``: it may have).
        """
        r = self.settings.redis
        try:
            if not (r.sentinels and r.wait_replicas > 0):
                return await commit(self.redis, attempt, admit)
            found = await self.redis.get(attempt.key)
            if found is not None:
                return bytes(found)
            await admit()
            found = await self._io(commit_waiting, self.client, attempt)
            return None if found is None else bytes(found)
        except FleetError:
            raise
        except BROKER_FAULTS as exc:
            raise broker_unavailable(exc, "could not create the job") from None

    async def _release(self, refs: list[dict[str, Any]]) -> None:
        if refs:
            try:
                await self._io(self.client.release_inputs, {"refs": refs})
            except Exception:
                log.warning("could not release input segments", exc_info=True)

    # -- watching -------------------------------------------------------------------------
    async def snapshot(self, task_id: str) -> Snapshot | None:
        """The job and its result document (one MGET); ``None``: no such job."""
        raw_job, raw_meta = await self.redis.mget(
            [schema.job_key(task_id), schema.result_key(task_id)]
        )
        job = None if raw_job is None else Job.from_json(raw_job)
        if job is None:
            return None
        return Snapshot(job, decode_meta(raw_meta))

    async def current(self, job: Job) -> Snapshot:
        """``job``'s state now (one GET of its result document); releases its input segments
        when it is final (a repeated POST of a finished job answers its result)."""
        snap = Snapshot(job, decode_meta(await self.redis.get(schema.result_key(job.id))))
        if snap.final:
            await self._release(job.input_refs)
        return snap

    def watch(self, task_id: str) -> ResultWatch:
        """``task_id``'s result documents as they come (``producer.gateway.waiter``; use it in
        ``async with``); a final one read counts for the rate meters."""
        return ResultWatch(self.client, task_id, self._on_final)

    async def wait(self, job: Job, timeout_s: float) -> dict[str, Any] | None:
        """The final result document, or ``None`` after ``timeout_s`` (subscribed, confirmed,
        read once, then woken by the worker's publish: ``producer.gateway.waiter``); releases
        the job's input segments once it is final."""
        meta = await final_document(self.client, job.id, timeout_s, self._on_final)
        if meta is None:
            self._sent.observed(job.id)
        else:
            await self._release(job.input_refs)
        return meta

    async def resolve(self, result: Any) -> Any:
        """Tensor wire objects in a result (video frames, xmodal texts) as numpy arrays. Output
        segments are not released: a repeated GET reads them again; their TTL reclaims them."""
        if any(True for _ in iter_wires(result)):
            return await self._io(lambda: self.client.resolve(result, release=False))
        return result

    async def cancel(self, task_id: str) -> bool:
        """``AsyncFleetClient.cancel`` (one optimistic transaction, on the event loop): True
        if cancelled, False if already final.

        Raises:
            BrokerUnavailable: Redis refused the transaction or could not be reached.
        """
        try:
            return await self.client.cancel(task_id)
        except BROKER_FAULTS as exc:  # the client's own are BrokerUnavailable already
            raise broker_unavailable(exc, "could not cancel") from None
