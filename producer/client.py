"""``FleetClient``: the Python producer API. Never imports torch.

>>> client = FleetClient.from_settings()
>>> h = client.submit("text", {"text": "A man is playing a guitar."}, priority="realtime")
>>> h.get(timeout_s=5)["dim"]
384

Each request becomes one Celery task ``fleet.<modality>`` on the modality's queue, at the
Celery priority of its class, carrying a :class:`~shared.schema.TaskEnvelope`. Its deadline is
``submitted + timeout_s`` (the class default when ``timeout_s`` is ``None``; BULK has none).
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from celery import Celery
from celery.result import AsyncResult

from shared import keys, tracing
from shared.celery_app import make_app
from shared.errors import (
    FleetError,
    InvalidInput,
    PayloadTooLarge,
    QueueFull,
    UnsupportedModality,
    error_from_code,
)
from shared.priority import Priority
from shared.queue_stats import fleet_headers
from shared.schema import TaskEnvelope
from shared.settings import MODALITIES, Settings, load_settings

if TYPE_CHECKING:
    from shared.transport import ShmStore

READY_STATES = frozenset({"SUCCESS", "FAILURE", "REVOKED"})


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    """One request for :meth:`FleetClient.submit_many`."""

    modality: str
    inputs: dict[str, Any]
    priority: str = "normal"
    timeout_s: float | None = None
    task_id: str | None = None  # None: the id its video input is bound to, else a fresh one


class ResultHandle:
    """A submitted request: its task ``id`` and a way to wait for its outcome."""

    def __init__(self, client: FleetClient, task_id: str, envelope: TaskEnvelope) -> None:
        self.client = client
        self.id = task_id
        self.envelope = envelope

    def __repr__(self) -> str:
        return f"ResultHandle(id={self.id!r}, modality={self.envelope.modality!r})"

    def get(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Wait for the result (seconds) and return it.

        Raises:
            FleetError: the request failed; the subclass and ``.code`` are the worker's.
            TimeoutError: no result within ``timeout_s``.
        """
        out = self.outcome(timeout_s)
        self._release_transport_inputs()
        if "error" in out:
            raise error_from_code(out["error"]["code"], out["error"]["message"])
        return self._resolved(out["result"])

    # -- tensor transport (video, xmodal): a separate addition to get() -------------------
    # get() releases the request's input segments (the producer owns them; the worker only
    # maps them) once the final outcome is in, and turns tensor wire objects in the result
    # into numpy arrays (FleetClient.resolve), mapping and releasing the worker's output
    # segments. The resolved result is kept, so calling get() again returns it again.
    def _release_transport_inputs(self) -> None:
        if not getattr(self, "_inputs_released", False):
            self._inputs_released = True
            self.client.release_inputs(self.envelope.inputs)

    def _resolved(self, result: Any) -> Any:
        if not hasattr(self, "_resolved_result"):
            self._resolved_result = self.client.resolve(result)
        return self._resolved_result

    def outcome(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Wait and return ``{"result": ...}`` or ``{"error": {"code", "message", "type"}}``.

        Raises:
            TimeoutError: no result within ``timeout_s``.
        """
        res = AsyncResult(self.id, app=self.client.app)
        try:
            res.get(timeout=timeout_s, propagate=False, disable_sync_subtasks=False)
        except Exception as exc:  # celery.exceptions.TimeoutError is not a builtin one
            if type(exc).__name__ == "TimeoutError":
                raise TimeoutError(f"no result for {self.id} within {timeout_s} s") from None
            raise
        meta = res.backend.get_task_meta(self.id)
        return outcome_from_meta(meta)

    def state(self) -> str:
        """Celery's state of the task right now (PENDING, SUCCESS, FAILURE, ...)."""
        return AsyncResult(self.id, app=self.client.app).state


def outcome_from_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """Turn a Celery result meta (as read by the backend) into the client's outcome dict."""
    if meta.get("status") == "SUCCESS":
        return {"result": meta["result"]}
    res = meta.get("result")
    if meta.get("status") == "REVOKED" and not isinstance(res, FleetError):
        # stored by Celery's own revoke command (``celery control revoke``, Flower)
        return {"error": {"code": "REVOKED", "message": f"revoked: {res}", "type": "REVOKED"}}
    if isinstance(res, FleetError):
        return {"error": res.to_dict()}
    if isinstance(res, BaseException):
        args = list(res.args)
        code = args[1] if len(args) > 1 and isinstance(args[1], str) else "FLEET_ERROR"
        msg = str(args[0]) if args else repr(res)
        return {"error": {"code": code, "message": msg, "type": type(res).__name__}}
    if isinstance(res, dict) and "exc_message" in res:  # raw JSON exception encoding
        args = list(res.get("exc_message") or [])
        code = args[1] if len(args) > 1 else "FLEET_ERROR"
        msg = str(args[0]) if args else ""
        return {"error": {"code": code, "message": msg, "type": res.get("exc_type", "")}}
    status = meta.get("status")
    return {
        "error": {"code": "FLEET_ERROR", "message": f"task ended {status}", "type": str(status)}
    }


class FleetClient:
    """Submit inference requests to the fleet and read their results.

    Args:
        settings: fleet settings (Redis address and password, priorities, limits).
        app: a Celery app to reuse; built from ``settings`` when omitted.
        role: the Redis ACL user to connect as (``shared.acl``): ``producer`` (enqueue,
            results, cancel) unless a harness needs more (the bench purges and flushes).
    """

    def __init__(
        self, settings: Settings, app: Celery | None = None, *, role: str = "producer"
    ) -> None:
        self.settings = settings
        self.role = role
        self.app = app or make_app(settings, name="fleet-producer", role=role)
        tracing.configure(settings, "fleet-producer")  # off unless [tracing] says so

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> FleetClient:
        """A client for the fleet described by ``configs/fleet.toml`` and ``FLEET_*``."""
        return cls(settings or load_settings())

    # -- building envelopes -----------------------------------------------------------
    def envelope(
        self,
        modality: str,
        inputs: dict[str, Any],
        priority: str = "normal",
        timeout_s: float | None = None,
    ) -> TaskEnvelope:
        """Validate and build the envelope of one request (no I/O).

        Raises:
            UnsupportedModality: ``modality`` is not served.
            InvalidPriority: ``priority`` is not a class name.
            InvalidInput: ``inputs`` is not a JSON object or ``timeout_s`` is not positive.
            PayloadTooLarge: the inline payload exceeds ``limits.max_inline_bytes``, or a text
                ``limits.max_text_chars``.
        """
        if modality not in MODALITIES:
            raise UnsupportedModality(
                f"unknown modality {modality!r}; expected one of: {', '.join(MODALITIES)}"
            )
        prio = Priority.parse(priority)
        if not isinstance(inputs, dict):
            raise InvalidInput("inputs must be a JSON object")
        if timeout_s is not None and (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, int | float)
            or not (math.isfinite(timeout_s) and timeout_s > 0)
        ):
            raise InvalidInput(f"timeout_s must be a positive number of seconds, not {timeout_s!r}")
        try:
            size = len(json.dumps(inputs, separators=(",", ":"), allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"inputs are not JSON-serializable: {exc}") from None
        limit = self.settings.limits.max_inline_bytes
        if size > limit:
            raise PayloadTooLarge(f"inline inputs are {size} bytes; the limit is {limit}")
        self._check_texts(modality, inputs)
        now_ms = time.time() * 1000.0
        t = timeout_s if timeout_s is not None else prio.default_timeout_s(self.settings)
        return TaskEnvelope(
            modality=modality,
            priority=prio.label,
            submitted_ms=now_ms,
            deadline_ms=None if t is None else now_ms + t * 1000.0,
            inputs=inputs,
        )

    def _check_texts(self, modality: str, inputs: dict[str, Any]) -> None:
        """The workers' text length limit, here, before anything is sent (the workers check it
        again for producers that do not come through this client).

        Raises:
            PayloadTooLarge: a text over ``limits.max_text_chars`` characters.
        """
        if modality == "text":
            texts = [inputs.get("text")]
        elif modality == "xmodal":
            many = inputs.get("texts")
            texts = [inputs.get("text"), *(many if isinstance(many, list) else [])]
        else:
            return
        limit = self.settings.limits.max_text_chars
        for text in texts:
            if isinstance(text, str) and len(text) > limit:
                raise PayloadTooLarge(
                    f"text has {len(text)} characters; the limit is {limit} "
                    "([limits] max_text_chars)"
                )

    # -- submitting -----------------------------------------------------------------
    def submit(
        self,
        modality: str,
        inputs: dict[str, Any],
        priority: str = "normal",
        timeout_s: float | None = None,
        task_id: str | None = None,
    ) -> ResultHandle:
        """Enqueue one request; returns at once with its handle.

        Args:
            task_id: the request's id (default: the one :meth:`video_inputs` bound its video
                input to, else a fresh uuid4).

        Raises:
            FleetError: invalid request (see :meth:`envelope`), or ``QueueFull`` when the
                modality's queue holds ``max_queue_length`` messages.
        """
        return self.submit_many([SubmitRequest(modality, inputs, priority, timeout_s, task_id)])[0]

    def submit_many(self, requests: Iterable[SubmitRequest]) -> list[ResultHandle]:
        """Enqueue many requests over one broker connection.

        Every request is validated before any is sent: one invalid request raises and none
        is sent. Raises as :meth:`submit`.
        """
        requests = list(requests)
        envs = [self.envelope(r.modality, r.inputs, r.priority, r.timeout_s) for r in requests]
        ids: list[str] = []
        for r in requests:  # the same video input twice: the second request gets an id of its own
            task_id = self._task_id(r)
            ids.append(str(uuid.uuid4()) if r.task_id is None and task_id in ids else task_id)
        self._check_backpressure(envs)
        handles: list[ResultHandle] = []
        with self.app.producer_or_acquire() as producer:
            for env, task_id in zip(envs, ids, strict=True):
                self.publish(
                    producer,
                    env,
                    task_id,
                    keys.queue_for(env.modality, env.priority),
                    Priority.parse(env.priority).celery_priority(self.settings),
                )
                handles.append(ResultHandle(self, task_id, env))
                self._unbind(env.inputs)
        return handles

    # video inputs are bound to the request that will carry them (see video_inputs)
    @property
    def _bound(self) -> dict[str, str]:
        """Segment id -> the task id :meth:`video_inputs` bound it to, until it is sent."""
        return self.__dict__.setdefault("_bound_ids", {})

    def _task_id(self, request: SubmitRequest) -> str:
        """The id ``request`` is sent with: its own, else the one its video input is bound
        to, else a fresh uuid4.

        Raises:
            InvalidInput: ``request.task_id`` is not the id its video input is bound to (the
                input would be kept for a request that never runs, until the lifetime cap).
        """
        wires = _wires(request.inputs, "shm")
        bound = {self._bound[w["id"]] for w in wires if w["id"] in self._bound}
        if request.task_id is not None and bound - {request.task_id}:
            raise InvalidInput(
                f"the video input was made for request {sorted(bound)[0]} (video_inputs), not "
                f"{request.task_id}: pass that task_id to video_inputs, or no task_id here"
            )
        if request.task_id is not None:
            return request.task_id
        return sorted(bound)[0] if bound else str(uuid.uuid4())

    def _unbind(self, inputs: dict[str, Any]) -> None:
        """Sent: a second request with the same inputs gets an id of its own."""
        for wire in _wires(inputs, "shm"):
            self._bound.pop(wire["id"], None)

    def publish(
        self, producer: Any, env: TaskEnvelope, task_id: str, queue: str, celery_priority: int
    ) -> None:
        """Send one task message (Celery protocol 2, with its ``task-sent`` event).

        ``app.send_task`` without the result subscription: Celery's ``send_task`` also
        subscribes to the task's result channel on the backend's pubsub (and unsubscribes
        when the returned ``AsyncResult`` is collected), two commands per request that a
        client reading results by polling (``poll``/``wait_all``) never uses; a quarter of
        the bench generator's sending thread, on the cores the workers need. ``get()``
        subscribes when it is called (Celery's ``AsyncResult.get`` reads a result that is
        already stored, then waits on the channel).

        Args:
            producer: a kombu producer from ``app.producer_or_acquire()``.
            env: the validated request; travels as the task's kwargs.
            queue: a queue name from :mod:`shared.keys`; celery_priority: 0 (first) .. 9.

        Raises:
            kombu/redis connection errors, as ``send_task``.
        """
        amqp = self.app.amqp
        name = keys.task_name(env.modality)
        message = amqp.create_task_message(
            task_id,
            name,
            (),
            env.to_kwargs(),
            reply_to=self.app.thread_oid,
            create_sent_event=self.app.conf.task_send_sent_event,
        )
        message.headers.update(fleet_headers(env))
        with (
            tracing.producer_span(message.headers, env.modality, task_id),
            producer.connection._reraise_as_library_errors(),
        ):
            amqp.send_task_message(producer, name, message, queue=queue, priority=celery_priority)

    def poll(self, handles: Sequence[ResultHandle]) -> list[dict[str, Any] | None]:
        """Read the outcomes of many requests in one round trip, without waiting.

        Returns, per handle, ``None`` while it has no result, else its outcome dict (see
        :meth:`ResultHandle.outcome`) with ``done_ms``: when the worker stored it (epoch ms).
        """
        if not handles:
            return []
        backend = self.app.backend
        raw = backend.client.mget([backend.get_key_for_task(h.id) for h in handles])
        out: list[dict[str, Any] | None] = []
        for value in raw:
            if value is None:
                out.append(None)
                continue
            meta = backend.decode_result(value)
            if meta.get("status") not in READY_STATES:  # PROGRESS, STARTED, RETRY: running
                out.append(None)
                continue
            outcome = outcome_from_meta(meta)
            outcome["done_ms"] = _epoch_ms(meta.get("date_done"))
            out.append(outcome)
        return out

    def wait_all(
        self, handles: Sequence[ResultHandle], timeout_s: float = 60.0, interval_s: float = 0.02
    ) -> list[dict[str, Any] | None]:
        """Poll until every handle has an outcome or ``timeout_s`` passes (``None`` = none)."""
        deadline = time.monotonic() + timeout_s
        results: list[dict[str, Any] | None] = [None] * len(handles)
        todo = list(range(len(handles)))
        while todo and time.monotonic() < deadline:
            got = self.poll([handles[i] for i in todo])
            results_left = []
            for i, r in zip(todo, got, strict=True):
                if r is None:
                    results_left.append(i)
                else:
                    results[i] = r
            todo = results_left
            if todo:
                time.sleep(interval_s)
        return results

    def queue_depth(self, modality: str) -> dict[str, int]:
        """Messages waiting in ``modality``'s queue, per priority class (one round trip).

        Uses a pooled broker connection: cheap enough to call before every submission.
        """
        names = [p.label for p in Priority]
        prios = [Priority.parse(n).celery_priority(self.settings) for n in names]
        with self.app.pool.acquire(block=True) as conn:
            client = conn.default_channel.client
            with client.pipeline(transaction=False) as pipe:
                for name, p in zip(names, prios, strict=True):
                    queue = keys.queue_for(modality, name)
                    pipe.llen(keys.priority_list_key(queue, p))
                counts = pipe.execute()
        return dict(zip(names, (int(c) for c in counts), strict=True))

    def live_workers(self, modality: str) -> list[str]:
        """Node names of ``modality``'s batching workers that are ready and alive: those
        whose last heartbeat (``fleet:live:<modality>``, written with every lease renewal)
        is younger than ``[redis] lease_s``. One round trip.

        Raises:
            kombu/redis connection errors: Redis is unreachable.
        """
        since = time.time() - self.settings.redis.lease_s
        with self.app.pool.acquire(block=True) as conn:
            client = conn.default_channel.client
            nodes = client.zrangebyscore(keys.live_key(modality), since, "+inf")
        return sorted(n.decode() if isinstance(n, bytes) else str(n) for n in nodes)

    def cancel(self, task_id: str, reason: str = "cancelled by its producer") -> bool:
        """Cancel a request that has no final result yet: it ends ``REVOKED``.

        No Lua (a producer's Redis user may not run scripts): ``SET fleet:final:<id> 1 NX EX
        <result_expires_s>`` claims the request's one final result first; only if that set it,
        the REVOKED document (Celery's result meta, the shape ``workers.results`` stores, with
        ``Revoked``'s exception encoding: code ``REVOKED``) is stored with SETEX on the result
        key and PUBLISHed on it (what Celery's result consumers and the gateway wait on).
        Workers check the marker before every batch and ack such a request unrun, and their
        own result write is first-wins on the same marker: a request still queued or held in
        a worker's prefetch window never runs. One whose batch was already running finishes
        computing, but its result is dropped (REVOKED stands).

        If this process dies between the two steps the request has a final marker and no
        document: it never runs, and reads as PENDING until the marker expires.

        Returns:
            True if this call cancelled it; False if it already had a final result (stored by
            a worker, or an earlier cancel).

        Raises:
            redis errors: Redis is unreachable or refused a command.
        """
        from datetime import UTC, datetime

        from shared.errors import Revoked

        backend = self.app.backend
        ttl = int(self.settings.redis.result_expires_s)
        if not backend.client.set(keys.final_key(task_id), "1", nx=True, ex=ttl):
            return False
        err = Revoked(reason)
        meta = {
            "status": "REVOKED",
            "result": {
                "exc_type": type(err).__name__,
                "exc_message": [err.message, err.code],
                "exc_module": type(err).__module__,
            },
            "traceback": None,
            "children": [],
            "date_done": datetime.now(UTC).isoformat(),
            "task_id": task_id,
        }
        value = backend.encode(meta)
        key = backend.get_key_for_task(task_id)
        with backend.client.pipeline(transaction=False) as pipe:
            pipe.setex(key, ttl, value)
            pipe.publish(key, value)
            pipe.execute()
        return True

    # -- tensor transport (video, xmodal) ----------------------------------------------
    def shm(self) -> ShmStore:
        """This client's shared-memory store (``[transport]`` settings), opened on first use.

        Raises:
            TransportError: no usable /dev/shm root (see :class:`shared.transport.ShmStore`).
        """
        store = self.__dict__.get("_shm_store")
        if store is None:
            from shared.transport import store_from_settings

            store = self.__dict__["_shm_store"] = store_from_settings(self.settings)
        return store

    def close(self) -> None:
        """Give back what this client holds: its store's mappings and the released segment
        files it kept for reuse (``[transport] recycle_bytes``; other producers' stay), and
        the Celery app's connections. Segments still in flight stay (their TTLs and owners
        govern them)."""
        store = self.__dict__.pop("_shm_store", None)
        try:
            if store is not None:
                store.trim_pool(only_own=True)
                store.close()
        finally:
            self.app.close()

    def video_inputs(
        self,
        path_or_bytes: str | Path | bytes,
        ttl_s: float | None = None,
        task_id: str | None = None,
    ) -> dict[str, Any]:
        """Inputs for a video request: ``video_ref`` through /dev/shm, ``video_b64`` if small.

        Files above :data:`VIDEO_INLINE_MAX_BYTES` go through shared memory (a detached
        segment with ``ttl_s``, default ``transport.default_ttl_s``) unless
        ``transport.shared_host`` is false. The segment is bound to the request that carries
        it: ``task_id`` (then send the request with that id: ``submit(..., task_id=...)``),
        or else a fresh id that the first :meth:`submit` of these inputs gives its request.
        The workers then renew its TTL while that request may still run, however long it
        waits in its queue, up to ``[transport] max_ref_lifetime_s`` (see
        ``shared.transport.lifetime``). Send it in one request only.

        The segment is this client's: ``ResultHandle.get`` releases it after the final
        outcome; call :meth:`release_inputs` yourself when you read results another way
        (``wait_all``/``poll``) or do not send them, or let the TTL reclaim it (after the
        request is final; an unsent one at the lifetime cap).

        Raises:
            ShmCapacityError: the shared-memory budget is exhausted.
            ValueError: a malformed ``task_id``.
        """
        store = self.shm() if self.settings.transport.shared_host else None
        if task_id is not None:  # the caller sends its request with that id
            return video_inputs(path_or_bytes, store, ttl_s=ttl_s, request_id=task_id)
        task_id = str(uuid.uuid4())
        inputs = video_inputs(path_or_bytes, store, ttl_s=ttl_s, request_id=task_id)
        for wire in _wires(inputs, "shm"):
            self._bound[wire["id"]] = task_id
        return inputs

    def resolve(self, result: Any, release: bool = True) -> Any:
        """Replace tensor wire objects in a result with numpy arrays (see :func:`resolve_tensors`).

        ``{"kind": "shm", ...}`` refs are mapped zero-copy (a read-only array) and, with
        ``release``, their segments are released at once (the array stays valid);
        ``{"kind": "inline", ...}`` objects are decoded. Other values are returned unchanged.

        Raises:
            TensorRefError: a ref that is unknown (already released, expired, another host).
        """
        return resolve_tensors(result, self.shm, release=release)

    def release_inputs(self, inputs: Any) -> int:
        """Release the shared-memory segments referenced by a request's inputs.

        Returns:
            How many segments were removed (refs already gone count 0).
        """
        refs = list(_wires(inputs, "shm"))
        if not refs:
            return 0
        self._unbind(inputs)
        store = self.shm()
        removed = 0
        for ref in refs:
            with contextlib.suppress(FleetError):
                removed += bool(store.release(ref))
        return removed

    def _check_backpressure(self, envs: Sequence[TaskEnvelope]) -> None:
        """Refuse the whole submission if any queue would pass its configured maximum.

        Raises:
            QueueFull: a modality's total, or one priority's, limit would be exceeded.
        """
        for modality in {e.modality for e in envs}:
            cfg = self.settings.modalities.get(modality)
            if cfg is None or not (cfg.max_queue_length or cfg.max_queue_length_by_priority):
                continue
            depth = self.queue_depth(modality)
            adding = [e for e in envs if e.modality == modality]
            total = sum(depth.values())
            if cfg.max_queue_length and total + len(adding) > cfg.max_queue_length:
                raise QueueFull(
                    f"{modality} queue holds {total} requests; the limit is {cfg.max_queue_length}"
                )
            for prio, limit in cfg.max_queue_length_by_priority.items():
                n = sum(e.priority == prio for e in adding)
                if n and depth.get(prio, 0) + n > limit:
                    raise QueueFull(
                        f"{modality}/{prio} queue holds {depth.get(prio, 0)} requests; "
                        f"the limit is {limit}"
                    )


def _epoch_ms(date_done: Any) -> float | None:
    from datetime import datetime

    if isinstance(date_done, datetime):
        return date_done.timestamp() * 1000.0
    if isinstance(date_done, str):
        return datetime.fromisoformat(date_done).timestamp() * 1000.0
    return None


def image_inputs(path_or_bytes: str | Path | bytes) -> dict[str, Any]:
    """Inputs for an image request from a file path or the file's bytes."""
    data = path_or_bytes if isinstance(path_or_bytes, bytes) else Path(path_or_bytes).read_bytes()
    return {"image_b64": base64.b64encode(data).decode("ascii")}


# -- tensor transport helpers (video, xmodal) ------------------------------------------------
VIDEO_INLINE_MAX_BYTES = 32 * 1024
"""Video files up to this size travel inline as base64 (about 44 KB in the message), larger
ones through /dev/shm, so a task message stays under 64 KB whatever the video's size."""

_SHM_KEYS = frozenset({"kind", "id", "shape", "dtype", "nbytes", "owner", "created_at", "ttl_s"})
_INLINE_KEYS = frozenset({"kind", "dtype", "shape", "nbytes", "b64"})


def video_inputs(
    path_or_bytes: str | Path | bytes,
    store: ShmStore | None = None,
    *,
    inline_max_bytes: int = VIDEO_INLINE_MAX_BYTES,
    ttl_s: float | None = None,
    request_id: str | None = None,
) -> dict[str, Any]:
    """Inputs for a video request from a file path or the file's bytes.

    Args:
        path_or_bytes: the encoded video file (MP4/MOV, MKV/WebM, AVI, MPEG-TS).
        store: where to put files above ``inline_max_bytes`` (``{"video_ref": ...}``, a
            detached 1-D uint8 segment); ``None``: always inline (``{"video_b64": ...}``,
            bounded by ``limits.max_inline_bytes`` at submit).
        inline_max_bytes: largest file sent inline when a store is given.
        ttl_s: the segment's lifetime (default: the store's); the worker must map it before,
            unless its lease is renewed (``request_id``).
        request_id: the task id of the request that will carry it: its TTL is then renewed
            while that request may still run (see ``shared.transport.lifetime``).

    The caller owns the segment: release it after the request's final outcome
    (``ResultHandle.get`` and ``FleetClient.release_inputs`` do), else its TTL reclaims it.

    Raises:
        ShmCapacityError: the shared-memory budget is exhausted.
    """
    data = path_or_bytes if isinstance(path_or_bytes, bytes) else Path(path_or_bytes).read_bytes()
    if store is None or len(data) <= inline_max_bytes:
        return {"video_b64": base64.b64encode(data).decode("ascii")}
    import numpy as np

    ref = store.put(
        np.frombuffer(data, dtype=np.uint8), ttl_s=ttl_s, detach=True, request_id=request_id
    )
    return {"video_ref": ref.to_dict()}


def xmodal_inputs(image: str | Path | bytes, texts: str | Sequence[str]) -> dict[str, Any]:
    """Inputs for a cross-modal request: an image (path or bytes) and 1-16 texts."""
    out = image_inputs(image)
    out["texts"] = [texts] if isinstance(texts, str) else list(texts)
    return out


def resolve_tensors(obj: Any, store: Callable[[], ShmStore], *, release: bool = True) -> Any:
    """A copy of ``obj`` (a result) with every tensor wire object replaced by a numpy array.

    Args:
        obj: a JSON-like value (dicts, lists, scalars).
        store: returns the :class:`ShmStore` to map refs with (called only if there is one).
        release: release each mapped segment at once (the mapping stays valid; tmpfs frees
            the pages when the array is garbage-collected).

    Raises:
        TensorRefError: an unknown, expired or malformed ref.
        InvalidInput: a malformed inline tensor.
    """
    if isinstance(obj, dict):
        kind = obj.get("kind")
        if kind == "shm" and set(obj) == _SHM_KEYS:
            s = store()
            arr = s.get(obj)
            if release:
                s.release(obj)
            return arr
        if kind == "inline" and set(obj) == _INLINE_KEYS:
            from shared.transport import decode_inline

            return decode_inline(obj)
        return {k: resolve_tensors(v, store, release=release) for k, v in obj.items()}
    if isinstance(obj, list) and obj and isinstance(obj[0], dict | list):
        return [resolve_tensors(v, store, release=release) for v in obj]
    return obj


def _wires(obj: Any, kind: str) -> Iterable[dict[str, Any]]:
    """Every tensor wire object of ``kind`` inside ``obj``."""
    keys = _SHM_KEYS if kind == "shm" else _INLINE_KEYS
    if isinstance(obj, dict):
        if obj.get("kind") == kind and set(obj) == keys:
            yield obj
            return
        for v in obj.values():
            yield from _wires(v, kind)
    elif isinstance(obj, list):
        for v in obj:
            if isinstance(v, dict | list):
                yield from _wires(v, kind)
