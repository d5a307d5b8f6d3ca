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

This module builds, routes and publishes requests (:class:`FleetClient`,
:class:`SubmitRequest`). :class:`ClientBase` is what both clients (this one and
``producer.client.asyncio_client.AsyncFleetClient``) are without I/O: validation, task ids,
the messages (``producer.client.wire``), the queue-length check to ask, the client's /dev/shm
store. :class:`Publishing` (composed into FleetClient) is the blocking broker side: task
messages out (many in pipelined transactions, or one through kombu), the queue depths and the
backpressure check before a submission, the live workers of a modality. :func:`image_inputs`,
:func:`video_inputs` and :func:`xmodal_inputs` build a request's inputs from files (a video
above :data:`VIDEO_INLINE_MAX_BYTES` goes through /dev/shm). The package's other modules are
listed in ``producer/client/__init__.py``, which every public name is imported from.

Private kombu/Celery names (read from kombu 5.7.0; ``tests/unit/test_private_names.py``):
    kombu.connection.Connection: _reraise_as_library_errors
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import math
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

from celery import Celery

from producer.client.results import ResultHandle, ResultReading, resolve_tensors, tensor_wires
from producer.client.wire import DepthCheck, Outgoing, PayloadBuilder, Pusher, fresh_ids
from shared import model_routes, schema, tenant_quota, tenants, tracing
from shared.celery_app import make_app
from shared.clock import RedisClock
from shared.errors import FleetError, InvalidInput, PayloadTooLarge, UnsupportedModality
from shared.queue_stats import fleet_headers
from shared.redis_refusal import BROKER_FAULTS, broker_unavailable, reason_of
from shared.schema import Priority, TaskEnvelope
from shared.settings import MODALITIES, Settings, load_settings, url_fields
from shared.tensor_wire import SHM

if TYPE_CHECKING:
    from shared.transport import ShmStore

__all__ = [
    "CHUNK",
    "VIDEO_INLINE_MAX_BYTES",
    "ClientBase",
    "FleetClient",
    "Outgoing",
    "Publishing",
    "Submission",
    "SubmitRequest",
    "image_inputs",
    "node_names",
    "push_messages",
    "video_inputs",
    "xmodal_inputs",
]


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    """One request for :meth:`FleetClient.submit_many`."""

    modality: str
    inputs: dict[str, Any]
    priority: str = "normal"
    timeout_s: float | None = None
    task_id: str | None = None  # None: the id its video input is bound to, else a fresh one
    model: str | None = None  # a served name or table name; None: the modality's default
    version: str | None = None  # the model's version; None: its latest (shared.model_routes)
    tenant: str | None = None  # None: the default tenant (shared.tenants)


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


def _inline_too_large(inputs: dict[str, Any], size: int, limit: int) -> PayloadTooLarge:
    """The refusal of inputs whose JSON is ``size`` bytes, over ``limit`` (``[limits]
    max_inline_bytes``), naming the sizes that matter: a file travels as base64 (4 bytes for
    every 3), so each ``*_b64`` input's file size and encoded size are named too, and how
    large a file may be to fit."""
    files = [(k, v) for k, v in inputs.items() if k.endswith("_b64") and isinstance(v, str)]
    parts = []
    for key, encoded in files:
        raw = len(encoded) // 4 * 3 - encoded[-2:].count("=")
        parts.append(f"{key}: a {raw:,}-byte file is {len(encoded):,} bytes as base64")
    message = f"inline inputs are {size:,} bytes as JSON"
    if parts:
        message += f" ({'; '.join(parts)})"
    message += f"; the limit is {limit:,} bytes ([limits] max_inline_bytes)"
    if len(files) == 1:
        room = limit - (size - len(files[0][1]))  # what the rest of the JSON leaves
        message += f": a file of at most {max(room, 0) // 4 * 3:,} bytes fits"
    return PayloadTooLarge(message)


CHUNK = 250  # requests per MULTI/EXEC transaction of publish_many


BUILD_BATCH = 50  # messages outgoing builds in one PayloadBuilder.build_many call


H = TypeVar("H")


@dataclass(slots=True)
class Submission(Generic[H]):
    """One ``submit_many`` call before its I/O: the requests validated (``envs``), their task
    ids, the queue-length check to ask (``None``: no limit applies), the messages (built as
    they are consumed), and the handles of the requests on Redis so far (:meth:`sent`).

    Both clients make one with :meth:`ClientBase._submission` and differ only in how the
    messages reach Redis; ``handle(client, task_id, envelope)`` makes a handle of theirs.
    """

    client: ClientBase
    envs: list[TaskEnvelope]
    ids: list[str]
    check: DepthCheck | None
    messages: Iterator[Outgoing]
    handle: Callable[[Any, str, TaskEnvelope], H]
    unbind: bool  # some video input waits for its request (see ClientBase.video_inputs)
    handles: list[H] = field(default_factory=list)

    def sent(self, n: int) -> None:
        """The first ``n`` requests are on Redis: a handle for each one not counted yet."""
        for i in range(len(self.handles), n):
            self.handles.append(self.handle(self.client, self.ids[i], self.envs[i]))
            if self.unbind:
                self.client._unbind(self.envs[i].inputs)


class ClientBase:
    """What :class:`FleetClient` and ``AsyncFleetClient`` share, without I/O: the settings,
    the Celery app (its message templates and result decoding; only FleetClient uses its
    connections), Redis' clock (each client samples it its own way), validation, task ids,
    the messages and their ``task-sent`` events (``producer.client.wire``), the queue-length
    check to ask before sending, and the client's /dev/shm store.

    Args:
        settings: fleet settings (Redis address and password, priorities, limits).
        app: a Celery app to reuse; built from ``settings`` when omitted.
        role: the Redis ACL user to connect as (``shared.acl``): ``producer`` (enqueue,
            results, cancel) unless a harness needs more (the bench purges and flushes).
    """

    clock: RedisClock

    def __init__(
        self, settings: Settings, app: Celery | None = None, *, role: str = "producer"
    ) -> None:
        self.settings = settings
        self.role = role
        self.app = app or make_app(settings, name="fleet-producer", role=role)
        tracing.configure(settings, "fleet-producer")  # off unless [tracing] says so

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> Self:
        """A client for the fleet the settings describe: ``configs/fleet.toml`` (the copy
        packaged with the client outside a checkout), ``FLEET_REDIS_URL`` and ``FLEET_*``."""
        return cls(settings or load_settings())

    @classmethod
    def from_url(cls, url: str, **overrides: Any) -> Self:
        """A client of the fleet whose Redis ``url`` names, e.g.
        ``redis://producer:<password>@host:6390/0``, or behind Sentinel
        ``sentinel://producer:<password>@host:26379;sentinel://...@host2:26379/0?master_name=mmfleet&sentinel_password=<password>``
        (``shared.settings.url_fields``). The URL's keys win over ``FLEET_*`` and the config;
        the rest of the settings are read as :meth:`from_settings` reads them. ``overrides``:
        other settings sections, as :func:`shared.settings.load_settings` takes them.

        Raises:
            ValueError: a URL that is not one of those forms (the message says why; the
                password is not in it).
        """
        redis = {**url_fields(url), **overrides.pop("redis", {})}
        return cls(load_settings(redis=redis, **overrides))

    # -- building envelopes -----------------------------------------------------------
    def envelope(
        self,
        modality: str,
        inputs: dict[str, Any],
        priority: str = "normal",
        timeout_s: float | None = None,
        model: str | None = None,
        version: str | None = None,
    ) -> TaskEnvelope:
        """Validate and build the envelope of one request (no I/O). ``model`` and
        ``version`` name the model (``shared.model_routes.resolve``; the envelope carries
        its table name); ``None``: the modality's default.

        Raises:
            UnsupportedModality: ``modality`` is not served.
            ModelNotFound: the modality serves no such model (or version).
            InvalidPriority: ``priority`` is not a class name.
            InvalidInput: ``inputs`` is not a JSON object or ``timeout_s`` is not positive.
            PayloadTooLarge: the inline payload exceeds ``limits.max_inline_bytes``, or a text
                ``limits.max_text_chars``.
        """
        return self._validated(modality, inputs, priority, timeout_s, model, version)[0]

    def _validated(
        self,
        modality: str,
        inputs: dict[str, Any],
        priority: str,
        timeout_s: float | None,
        model: str | None = None,
        version: str | None = None,
    ) -> tuple[TaskEnvelope, bytes]:
        """:meth:`envelope`'s envelope and its inputs' JSON (UTF-8, compact: what the message
        carries, measured against ``max_inline_bytes``). Raises as :meth:`envelope`."""
        request = SubmitRequest(modality, inputs, priority, timeout_s, model=model, version=version)
        envs, datas = self._validated_many([request])
        return envs[0], datas[0]

    @property
    def routes(self) -> model_routes.Routes:
        """This client's routing table (``shared.model_routes.Routes``), made once per
        settings (they are frozen)."""
        cached = self.__dict__.get("_route_table")
        if cached is None or cached.settings is not self.settings:
            cached = self.__dict__["_route_table"] = model_routes.Routes(self.settings)
        return cached

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
                raise _inline_too_large(inputs, len(data), max_inline)
            if modality in _TEXT_MODALITIES:
                _check_texts(modality, inputs, max_chars)
            fields = {
                "modality": modality,
                "priority": label,
                "submitted_ms": now_ms,
                "deadline_ms": None if timeout_s is None else now_ms + timeout_s * 1000.0,
                "inputs": inputs,
            }
            if r.model is not None or r.version is not None:  # named: its table travels
                fields["model"] = self.routes.served(modality, r.model, r.version).table
            if r.tenant is not None:
                fields["tenant"] = tenants.check_name(r.tenant)
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

    def payloads(self) -> PayloadBuilder:
        """This client's message builder (``producer.client.wire``), made on first use."""
        builder = self.__dict__.get("_payloads")
        if builder is None:
            builder = self.__dict__["_payloads"] = PayloadBuilder(self.app)
        return builder

    def message(self, env: TaskEnvelope, task_id: str) -> Outgoing:
        """The message of one validated request ``env`` (:meth:`envelope`) with id
        ``task_id``: the bytes :meth:`outgoing` builds, on the queue and priority of its class,
        without a ``task-sent`` event. For a caller that puts it on Redis in a transaction of
        its own (``LPUSH`` of ``key`` and ``payload``): the HTTP gateway's job commit
        (``producer.gateway.commit``)."""
        route = self.routes.queues
        built = self.payloads().build_many([(env, task_id, None)], route, self.app.thread_oid)
        if self.settings.tenants:  # its tenant's list and max_queued (see outgoing)
            built = self._tenanted([(env, task_id, None)], built)
        return built[0]

    def outgoing(
        self,
        envs: Iterable[TaskEnvelope],
        ids: Iterable[str],
        inputs_json: Iterable[bytes | None] | None = None,
    ) -> Iterator[Outgoing]:
        """The messages of validated requests ``envs`` with task ids ``ids``, built as they
        are consumed (``producer.client.wire``, :data:`BUILD_BATCH` at a time), each with its
        ``task-sent`` event when the app sends them (``task_send_sent_event``).
        ``inputs_json``: each request's inputs as its validation wrote them
        (``FleetClient._validated_many``), when the caller has them."""
        builder = self.payloads()
        events = bool(self.app.conf.task_send_sent_event)
        reply_to = self.app.thread_oid
        route = self.routes.queues
        datas = itertools.repeat(None) if inputs_json is None else inputs_json
        requests = zip(envs, ids, datas, strict=False)
        while part := list(itertools.islice(requests, BUILD_BATCH)):
            built = builder.build_many(part, route, reply_to, events)
            if self.settings.tenants:  # no [tenants]: every message as before
                built = self._tenanted(part, built)
            yield from built

    def _tenanted(
        self, part: list[tuple[TaskEnvelope, str, bytes | None]], built: list[Outgoing]
    ) -> list[Outgoing]:
        """``built`` with each request's tenant applied: its tenant list (fair share on, a
        ``[tenants]`` tenant; ``shared.tenants``) and its tenant's ``max_queued``
        (``shared.tenant_quota``)."""
        out = []
        settings = self.settings
        for (env, task_id, _), m in zip(part, built, strict=True):
            quota = tenant_quota.quota_of(settings, env.tenant, task_id)
            key = m.key
            if tenants.has_own_list(settings, env.tenant):
                queue, step = self.routes.queues[(env.modality, env.priority, env.model)]
                key = tenants.tenant_list_key(queue, step, env.tenant)
            out.append(m._replace(key=key, quota=quota) if quota or key != m.key else m)
        return out

    def _route_model(self, env: TaskEnvelope) -> str | None:
        """The model part of ``env``'s queue names (``None``: the modality's own)."""
        return None if env.model is None else self.routes.route_model(env.modality, env.model)

    def _depth_check(self, envs: Sequence[TaskEnvelope]) -> DepthCheck | None:
        """The queue-length check of a submission of ``envs`` (for :meth:`publish_many`):
        the priority lists of the queues it sends to whose modalities have limits (each
        model's queue holds the modality's limits on its own). ``None``: none has."""
        routes = [None if e.model is None else self._route_model(e) for e in envs]
        limited = set()
        for modality, route in set(zip([e.modality for e in envs], routes, strict=True)):
            cfg = self.settings.modalities.get(modality)
            if cfg is not None and (cfg.max_queue_length or cfg.max_queue_length_by_priority):
                limited.add((modality, route))
        if not limited:
            return None
        prios = {p.label: p.celery_priority(self.settings) for p in Priority}
        rows = [
            (
                modality,
                label,
                schema.priority_list_key(schema.queue_for(modality, label, route), step),
                route,
            )
            for modality, route in sorted(limited, key=lambda x: (x[0], x[1] or ""))
            for label, step in prios.items()
        ]
        if self.settings.tenants:  # the tenants' own lists count too
            rows += [
                (modality, label, key, route)
                for modality, route in sorted(limited, key=lambda x: (x[0], x[1] or ""))
                for label, step in prios.items()
                for key in tenants.tenant_lists(
                    self.settings, schema.queue_for(modality, label, route), step
                )
            ]
        return DepthCheck(self.settings, envs, rows, routes)

    def _submission(
        self,
        requests: list[SubmitRequest],
        now_ms: float,
        handle: Callable[[Any, str, TaskEnvelope], H],
    ) -> Submission[H]:
        """``requests`` validated (their submit time ``now_ms``, on Redis' clock), their ids,
        the queue-length check and the messages: everything before the I/O of
        ``submit_many``. ``handle(client, task_id, envelope)`` makes each request's handle.

        Raises:
            FleetError: as :meth:`envelope`, for the first request that is not valid.
        """
        envs, datas = self._validated_many(requests, now_ms)
        ids = self._task_ids(requests)
        unbind = bool(self._bound)  # some video input waits for its request
        check = self._depth_check(envs)
        messages = self.outgoing(envs, ids, datas)
        return Submission(self, envs, ids, check, messages, handle, unbind)

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

    def _close_store(self) -> None:
        """Give back the /dev/shm store's mappings and the released segment files it kept
        for reuse (``[transport] recycle_bytes``; other producers' stay). Segments still in
        flight stay (their TTLs and owners govern them)."""
        store = self.__dict__.pop("_shm_store", None)
        if store is not None:
            store.trim_pool(only_own=True)
            store.close()

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


class Publishing:
    """Publishing and queue state of a :class:`producer.client.FleetClient` (mixed into it),
    blocking: reads its ``app`` (the Celery app, its broker pool), ``settings`` and
    ``clock``, and its messages (:meth:`ClientBase.payloads`)."""

    if TYPE_CHECKING:
        app: Celery
        settings: Settings
        clock: RedisClock

        def payloads(self) -> PayloadBuilder: ...

    def publish(
        self, producer: Any, env: TaskEnvelope, task_id: str, queue: str, celery_priority: int
    ) -> None:
        """Send one task message (Celery protocol 2, with its ``task-sent`` event) through
        kombu's publish: the bench generator's path, one request per call. ``submit`` and
        ``submit_many`` send the same bytes pipelined (:meth:`publish_many`).

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
            queue: a queue name from :mod:`shared.schema`; celery_priority: 0 (first) .. 9.

        Raises:
            BrokerUnavailable: Redis refused it (``reason``: ``OOM``, ``MISCONF``,
                ``READONLY``, ``NOPERM``; at once), refused the credentials (``AUTH``; at
                once), is not Redis (``NOT_REDIS``) or could not be reached
                (``UNREACHABLE``), as :meth:`publish_many`.
        """
        try:
            self._publish_one(producer, env, task_id, queue, celery_priority)
        except BROKER_FAULTS as exc:
            if reason_of(exc) is None:
                raise
            raise broker_unavailable(exc, "could not publish") from exc

    def _publish_one(
        self, producer: Any, env: TaskEnvelope, task_id: str, queue: str, celery_priority: int
    ) -> None:
        amqp = self.app.amqp
        name = schema.task_name(env.modality)
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

    def publish_many(
        self,
        messages: Iterable[Outgoing],
        chunk: int = CHUNK,
        check: DepthCheck | None = None,
    ) -> Iterator[int]:
        """Push ``messages`` (from :meth:`outgoing`) in chunks of ``chunk``, one
        ``MULTI``/``EXEC`` transaction each (one round trip) on a pooled broker connection:
        a chunk is on Redis whole or not at all. Yields, after each chunk, how many messages
        are on Redis so far; stop iterating to send no more. Each chunk is built (``messages``
        consumed) while Redis takes the one before it. ``check``: ``submit_many``'s
        queue-length check, asked before the first chunk is built and judged before it is
        sent (``QueueFull``: nothing is sent). All on one connection (``producer.client.wire``).

        A chunk is one ``LPUSH`` per list kombu's publish would use (its messages in
        order: ``LPUSH k a b`` is ``LPUSH k a; LPUSH k b``) and one ``PUBLISH`` of the
        chunk's ``task-sent`` events as a group (``PayloadBuilder.sent_group``). Behind
        Sentinel (``wait_replicas``), a chunk is followed by ``WAIT`` on the same
        connection, with the waiter of kombu's publishes on that channel
        (``shared.ha.WaitingPut``): its backoff, and ``ReplicationUncertain`` (the chunk may
        be lost in a failover) retried as a connection error.

        Faults: a connection error retries the chunk as kombu's publish retries a message:
        ``task_publish_retry_policy`` (none when ``task_publish_retry`` is off), through
        kombu's ``Connection.ensure`` (reconnect, next failover URL, the policy's sleeps). A
        chunk whose ``EXEC`` ran but whose reply was lost is then pushed twice: the workers
        run a task id once and ack the other copy as a duplicate (``workers.batching.completion``).

        A refusal (Redis answered ``OOM``, ``MISCONF``, ``READONLY``, ``NOPERM``) is raised at
        once, never retried: sending it again gets the same answer (``shared.kombu_redis``).

        Raises:
            BrokerUnavailable: Redis refused a chunk (nothing of it applied), or stayed
                unreachable through the retries (the chunks yielded before are on Redis;
                the failing one may be; later ones were not sent). ``reason`` says which.
        """
        return push_messages(self.app, self.payloads(), messages, chunk, check)

    def queue_depth(self, modality: str, model: str | None = None) -> dict[str, int]:
        """Messages waiting in ``modality``'s queue (``model``: a model's, by table name),
        per priority class (one round trip).

        Uses a pooled broker connection: cheap enough to call before every submission.

        Raises:
            BrokerUnavailable: Redis refused it or could not be reached.
        """
        names = [p.label for p in Priority]
        prios = [Priority.parse(n).celery_priority(self.settings) for n in names]
        route = None if model is None else self.routes.route_model(modality, model)
        try:
            with self.app.pool.acquire(block=True) as conn:
                client = conn.default_channel.client
                with client.pipeline(transaction=False) as pipe:
                    for name, p in zip(names, prios, strict=True):
                        queue = schema.queue_for(modality, name, route)
                        pipe.llen(schema.priority_list_key(queue, p))
                        for key in tenants.tenant_lists(self.settings, queue, p):
                            pipe.llen(key)
                    counts = iter(pipe.execute())
        except BROKER_FAULTS as exc:
            if reason_of(exc) is None:
                raise
            raise broker_unavailable(exc, "could not read the queue depth") from exc
        per_list = 1 + len(tenants.tenant_lists(self.settings, modality, 0))
        return {n: sum(int(next(counts)) for _ in range(per_list)) for n in names}

    def live_workers(self, modality: str, model: str | None = None) -> list[str]:
        """Node names of ``modality``'s batching workers that are ready and alive: those
        whose last heartbeat (``fleet:live:<modality>``, written with every lease renewal)
        is younger than ``[redis] lease_s``, both on Redis' clock (``self.clock``; a
        producer or worker whose own clock is off sees the same). One round trip.
        ``model`` (a table name, as ``routes.served`` gives it): those serving that model
        (``fleet:live:<modality>@<table>``).

        Raises:
            BrokerUnavailable: Redis is unreachable or refused the read (``MISCONF``
                refuses a new connection's first ``PING``).
        """
        since = self.clock.now() - self.settings.redis.lease_s
        try:
            with self.app.pool.acquire(block=True) as conn:
                client = conn.default_channel.client
                key = schema.live_key(modality, model)
                nodes = client.zrangebyscore(key, since, "+inf")
        except BROKER_FAULTS as exc:
            if reason_of(exc) is None:
                raise
            raise broker_unavailable(exc, "could not read worker liveness") from exc
        return node_names(nodes)


def push_messages(
    app: Celery,
    builder: PayloadBuilder,
    messages: Iterable[Outgoing],
    chunk: int = CHUNK,
    check: DepthCheck | None = None,
) -> Iterator[int]:
    """:meth:`Publishing.publish_many` on ``app``'s broker pool (kombu's connection, its
    publish retry policy and, behind Sentinel, its ``WAIT``), the ``task-sent`` groups made
    by ``builder``: a blocking call (``AsyncFleetClient`` runs it on a thread where a publish
    waits for a replica)."""
    conf = app.conf
    retry = conf.task_publish_retry  # as Celery's send_task: retry=False, no retries
    policy = dict(conf.task_publish_retry_policy or {}) if retry else {"max_retries": 0}
    try:
        with app.pool.acquire(block=True) as conn:
            pusher = Pusher(conn, policy, conf.event_exchange, builder.sent_group)
            try:
                yield from pusher.chunks(iter(messages), chunk, check)
            finally:
                pusher.close()
    except BROKER_FAULTS as exc:
        if reason_of(exc) is None:
            raise
        raise broker_unavailable(exc, "could not publish") from exc


def node_names(raw: Iterable[Any]) -> list[str]:
    """A liveness set's members (``fleet:live:<modality>``) as sorted node names."""
    return sorted(n.decode() if isinstance(n, bytes) else str(n) for n in raw)


class FleetClient(ClientBase, Publishing, ResultReading):
    """Submit inference requests to the fleet and read their results (blocking calls; the
    asyncio client is ``producer.client.AsyncFleetClient``).

    Args:
        settings: fleet settings (Redis address and password, priorities, limits).
        app: a Celery app to reuse; built from ``settings`` when omitted.
        role: the Redis ACL user to connect as (``shared.acl``): ``producer`` (enqueue,
            results, cancel) unless a harness needs more (the bench purges and flushes).
    """

    def __init__(
        self, settings: Settings, app: Celery | None = None, *, role: str = "producer"
    ) -> None:
        super().__init__(settings, app, role=role)
        # Redis' clock: submit times, deadlines and liveness are compared across hosts
        self.clock = RedisClock(self._redis_time)

    def _redis_time(self) -> Any:
        """Redis' ``TIME`` (one round trip on a pooled broker connection)."""
        with self.app.pool.acquire(block=True) as conn:
            return conn.default_channel.client.time()

    # -- submitting -----------------------------------------------------------------
    def submit(
        self,
        modality: str,
        inputs: dict[str, Any],
        priority: str = "normal",
        timeout_s: float | None = None,
        task_id: str | None = None,
        model: str | None = None,
        version: str | None = None,
        *,
        tenant: str | None = None,
    ) -> ResultHandle:
        """Enqueue one request; returns at once with its handle.

        Args:
            task_id: the request's id (default: the one :meth:`video_inputs` bound its video
                input to, else a fresh uuid4).
            model: the model to run it (a served name, or a ``[models.<name>]`` table
                name); ``None``: the modality's default. ``version``: that model's version
                (``None``: its latest).
            tenant: who the request is for (``None``: the default tenant; docs/tenants.md).

        Raises:
            FleetError: invalid request (see :meth:`envelope`; ``ModelNotFound`` for a model
                the modality does not serve), ``QueueFull`` when the model's queue holds
                ``max_queue_length`` messages, or ``TenantQuota`` when the tenant has
                ``max_queued`` requests queued or running.
            BrokerUnavailable: Redis refused it (``reason``: ``OOM``, ``MISCONF``,
                ``READONLY``, ``NOPERM``; at once, never retried), refused the credentials
                (``AUTH``; at once) or is not Redis (``NOT_REDIS``), or stayed unreachable
                through the publish retries (``UNREACHABLE``; see :meth:`submit_many`).
        """
        request = SubmitRequest(
            modality, inputs, priority, timeout_s, task_id, model, version, tenant
        )
        return self.submit_many([request])[0]

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
        # Redis' clock, sampled when due (one TIME every refresh period, none per call)
        sub = self._submission(list(requests), self.clock.now() * 1000.0, ResultHandle)
        try:  # the check's answer comes while the first chunk is built
            for sent in self.publish_many(sub.messages, check=sub.check):
                sub.sent(sent)
        except Exception as exc:
            exc.submitted = sub.handles  # type: ignore[attr-defined]
            raise
        return sub.handles

    def close(self) -> None:
        """Give back what this client holds: its store's mappings and the released segment
        files it kept for reuse (``[transport] recycle_bytes``; other producers' stay), and
        the Celery app's connections. Segments still in flight stay (their TTLs and owners
        govern them)."""
        try:
            self._close_store()
        finally:
            self.app.close()


def image_inputs(path_or_bytes: str | Path | bytes) -> dict[str, Any]:
    """Inputs for an image request from a file path or the file's bytes."""
    data = path_or_bytes if isinstance(path_or_bytes, bytes) else Path(path_or_bytes).read_bytes()
    return {"image_b64": base64.b64encode(data).decode("ascii")}


VIDEO_INLINE_MAX_BYTES = 32 * 1024


"""Video files up to this size travel inline as base64 (about 44 KB in the message), larger
ones through /dev/shm, so a task message stays under 64 KB whatever the video's size."""


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
