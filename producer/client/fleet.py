"""``FleetClient``: the Python producer API. Never imports torch.

>>> client = FleetClient.from_settings()
>>> h = client.submit("text", {"text": "A man is playing a guitar."}, priority="realtime")
>>> h.get(timeout_s=5)["dim"]
384

Each request becomes one Celery task ``fleet.<modality>`` on the modality's queue, at the
Celery priority of its class, carrying a :class:`~shared.schema.TaskEnvelope`. Its deadline is
``submitted + timeout_s`` (the class default when ``timeout_s`` is ``None``; BULK has none),
both on Redis' clock (``client.clock``, ``shared.clock``: one ``TIME`` every 15 s, none per
request), which workers check it against: a host whose own clock is off changes nothing.

This module builds and submits requests (:class:`FleetClient`, :class:`SubmitRequest`) and
owns the client's /dev/shm store; the package's other modules are listed in
``producer/client/__init__.py``, which every public name is imported from.
"""

from __future__ import annotations

import contextlib
import math
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from celery import Celery

from producer.client.inputs import (
    resolve_tensors,
    tensor_wires,
    video_inputs,
)
from producer.client.publish import Publishing
from producer.client.results import ResultHandle, ResultReading
from producer.client.wire import fresh_ids
from shared import schema, tracing
from shared.celery_app import make_app
from shared.clock import RedisClock
from shared.errors import FleetError, InvalidInput, PayloadTooLarge, UnsupportedModality
from shared.schema import Priority, TaskEnvelope
from shared.settings import MODALITIES, Settings, load_settings
from shared.tensor_wire import SHM

if TYPE_CHECKING:
    from shared.transport import ShmStore

__all__ = ["FleetClient", "SubmitRequest"]


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    """One request for :meth:`FleetClient.submit_many`."""

    modality: str
    inputs: dict[str, Any]
    priority: str = "normal"
    timeout_s: float | None = None
    task_id: str | None = None  # None: the id its video input is bound to, else a fresh one


class FleetClient(Publishing, ResultReading):
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
        # Redis' clock: submit times, deadlines and liveness are compared across hosts
        self.clock = RedisClock(self._redis_time)
        tracing.configure(settings, "fleet-producer")  # off unless [tracing] says so

    def _redis_time(self) -> Any:
        """Redis' ``TIME`` (one round trip on a pooled broker connection)."""
        with self.app.pool.acquire(block=True) as conn:
            return conn.default_channel.client.time()

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
        return self._validated(modality, inputs, priority, timeout_s)[0]

    def _validated(
        self, modality: str, inputs: dict[str, Any], priority: str, timeout_s: float | None
    ) -> tuple[TaskEnvelope, bytes]:
        """:meth:`envelope`'s envelope and its inputs' JSON (UTF-8, compact: what the message
        carries, measured against ``max_inline_bytes``). Raises as :meth:`envelope`."""
        envs, datas = self._validated_many([SubmitRequest(modality, inputs, priority, timeout_s)])
        return envs[0], datas[0]

    def _validated_many(
        self, requests: list[SubmitRequest], now_ms: float | None = None
    ) -> tuple[list[TaskEnvelope], list[bytes]]:
        """:meth:`_validated` of each request, in one loop (the settings read once): their
        envelopes, and their inputs' JSON. The requests of one call share their submit time
        (``submitted_ms``, from which a deadline counts): ``now_ms``, else the client's
        Redis clock as last sampled (no I/O: validation alone never reaches Redis; the
        submit path samples it when due, :meth:`submit_many`).

        Raises:
            as :meth:`envelope`, for the first request that is not valid.
        """
        classes = self._classes()
        limits = self.settings.limits
        max_inline, max_chars = limits.max_inline_bytes, limits.max_text_chars
        if now_ms is None:
            now_ms = self.clock.peek() * 1000.0
        envs: list[TaskEnvelope] = []
        datas: list[bytes] = []
        for r in requests:
            modality, inputs, timeout_s = r.modality, r.inputs, r.timeout_s
            if modality not in MODALITIES:
                raise UnsupportedModality(
                    f"unknown modality {modality!r}; expected one of: {', '.join(MODALITIES)}"
                )
            found = classes.get(r.priority) if type(r.priority) is str else None
            label, default_timeout_s = found or classes[Priority.parse(r.priority).label]
            if not isinstance(inputs, dict):
                raise InvalidInput("inputs must be a JSON object")
            if timeout_s is None:
                timeout_s = default_timeout_s
            elif (
                isinstance(timeout_s, bool)
                or not isinstance(timeout_s, int | float)
                or not (math.isfinite(timeout_s) and timeout_s > 0)
            ):
                raise InvalidInput(
                    f"timeout_s must be a positive number of seconds, not {timeout_s!r}"
                )
            try:
                data = schema.compact(inputs)  # the UTF-8 JSON the request carries
            except (TypeError, ValueError) as exc:
                raise InvalidInput(f"inputs are not JSON-serializable: {exc}") from None
            if len(data) > max_inline:
                raise PayloadTooLarge(
                    f"inline inputs are {len(data)} bytes; the limit is {max_inline}"
                )
            if modality in _TEXT_MODALITIES:
                _check_texts(modality, inputs, max_chars)
            fields = {
                "modality": modality,
                "priority": label,
                "submitted_ms": now_ms,
                "deadline_ms": None if timeout_s is None else now_ms + timeout_s * 1000.0,
                "inputs": inputs,
            }
            envs.append(_validate_envelope(fields))  # TaskEnvelope(**fields): pydantic validates
            datas.append(data)
        return envs, datas

    def _classes(self) -> dict[str, tuple[str, float | None]]:
        """Class label -> (label, default timeout in s), made once per settings (they are
        frozen)."""
        table = self.__dict__.get("_class_table")
        if table is None or table[0] is not self.settings:
            rows = {p.label: (p.label, p.default_timeout_s(self.settings)) for p in Priority}
            table = self.__dict__["_class_table"] = (self.settings, rows)
        return table[1]

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
            BrokerUnavailable: Redis refused it (``reason``: ``OOM``, ``MISCONF``,
                ``READONLY``, ``NOPERM``; at once, never retried) or stayed unreachable
                through the publish retries (``UNREACHABLE``; see :meth:`submit_many`).
        """
        return self.submit_many([SubmitRequest(modality, inputs, priority, timeout_s, task_id)])[0]

    def submit_many(self, requests: Iterable[SubmitRequest]) -> list[ResultHandle]:
        """Enqueue many requests: pipelined, ``CHUNK`` requests per Redis transaction.

        Every request is validated, and the queue-length limits checked, before any is sent:
        one invalid request raises and none is sent. The messages are the bytes kombu's
        publish would push, with their ``task-sent`` events (:meth:`outgoing`), sent in
        chunks that each reach Redis whole or not at all, retried on connection errors
        and, behind Sentinel, confirmed by a replica (:meth:`publish_many`).

        Raises:
            FleetError: as :meth:`submit`, before anything is sent.
            BrokerUnavailable: Redis refused a chunk or stayed unreachable through the
                publish retries. Requests of the chunks sent before are queued (their handles
                are the exception's ``submitted`` attribute); the failing chunk's may be
                (a lost ``EXEC`` reply; a refused one was not applied); the rest were not
                sent.
        """
        requests = list(requests)
        # Redis' clock, sampled when due (one TIME every refresh period, none per call)
        envs, datas = self._validated_many(requests, self.clock.now() * 1000.0)
        ids = self._task_ids(requests)
        unbind = bool(self._bound)  # some video input waits for its request
        check = self._depth_check(envs)  # its answer comes while the first chunk is built
        messages = self.outgoing(envs, ids, datas)
        handles: list[ResultHandle] = []
        try:
            for sent in self.publish_many(messages, check=check):
                for i in range(len(handles), sent):
                    handles.append(ResultHandle(self, ids[i], envs[i]))
                    if unbind:
                        self._unbind(envs[i].inputs)
        except Exception as exc:
            exc.submitted = handles  # type: ignore[attr-defined]
            raise
        return handles

    # video inputs are bound to the request that will carry them (see video_inputs)
    @property
    def _bound(self) -> dict[str, str]:
        """Segment id -> the task id :meth:`video_inputs` bound it to, until it is sent."""
        return self.__dict__.setdefault("_bound_ids", {})

    def _task_ids(self, requests: list[SubmitRequest]) -> list[str]:
        """The ids ``requests`` are sent with (:meth:`_task_id`); two requests carrying one
        video input: the second gets a fresh id.

        Raises:
            InvalidInput: as :meth:`_task_id`.
        """
        fresh = fresh_ids(len(requests))
        if not self._bound and all(r.task_id is None for r in requests):
            return fresh
        ids: list[str] = []
        seen: set[str] = set()
        for r, new in zip(requests, fresh, strict=True):
            task_id = self._task_id(r, new)
            if r.task_id is None and task_id in seen:  # one video input for two requests
                task_id = new  # the second request gets an id of its own
            ids.append(task_id)
            seen.add(task_id)
        return ids

    def _task_id(self, request: SubmitRequest, fresh: str) -> str:
        """The id ``request`` is sent with: its own, else the one its video input is bound
        to, else ``fresh`` (a new uuid4).

        Raises:
            InvalidInput: ``request.task_id`` is not the id its video input is bound to (the
                input would be kept for a request that never runs, until the lifetime cap).
        """
        if not self._bound:  # no video input waits for its request: nothing to check
            return request.task_id if request.task_id is not None else fresh
        wires = tensor_wires(request.inputs, SHM)
        bound = {self._bound[w["id"]] for w in wires if w["id"] in self._bound}
        if request.task_id is not None and bound - {request.task_id}:
            raise InvalidInput(
                f"the video input was made for request {sorted(bound)[0]} (video_inputs), not "
                f"{request.task_id}: pass that task_id to video_inputs, or no task_id here"
            )
        if request.task_id is not None:
            return request.task_id
        return sorted(bound)[0] if bound else fresh

    def _unbind(self, inputs: dict[str, Any]) -> None:
        """Sent: a second request with the same inputs gets an id of its own."""
        if not self._bound:
            return
        for wire in tensor_wires(inputs, SHM):
            self._bound.pop(wire["id"], None)

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
        for wire in tensor_wires(inputs, SHM):
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
        refs = list(tensor_wires(inputs, SHM))
        if not refs:
            return 0
        self._unbind(inputs)
        store = self.shm()
        removed = 0
        for ref in refs:
            with contextlib.suppress(FleetError):
                removed += bool(store.release(ref))
        return removed


_TEXT_MODALITIES = frozenset({"text", "xmodal"})
_validate_envelope = TaskEnvelope.__pydantic_validator__.validate_python


def _check_texts(modality: str, inputs: dict[str, Any], limit: int) -> None:
    """The workers' text length limit (``[limits] max_text_chars``), here, before anything
    is sent (the workers check it again for producers that do not come through this client).

    Raises:
        PayloadTooLarge: a text over ``limit`` characters.
    """
    text = inputs.get("text")
    many = inputs.get("texts") if modality == "xmodal" else None
    texts = [text, *many] if isinstance(many, list) else (text,)  # most requests: one text
    for text in texts:
        if isinstance(text, str) and len(text) > limit:
            raise PayloadTooLarge(
                f"text has {len(text)} characters; the limit is {limit} ([limits] max_text_chars)"
            )
