"""Reading results: :class:`ResultHandle` (one request) and :class:`ResultReading` (many,
mixed into :class:`producer.client.FleetClient`: poll, wait_all, cancel).

An outcome is ``{"result": ...}`` or ``{"error": {"code", "message", "type"}}``
(:func:`outcome_from_meta` turns Celery's stored result meta into one). Import these names
from ``producer.client``.

Private kombu/Celery names (read from Celery 5.5 to 5.7; ``tests/unit/test_private_names.py``):
    celery.backends.redis.ResultConsumer: _reconnect_pubsub

Tensor wire objects in results become numpy arrays (:func:`resolve_tensors`; the walk that finds
them: :func:`tensor_wires`, ``shared.tensor_wire.iter_wires``). No torch; numpy and
``shared.transport`` are imported only when a tensor is at hand. Import these names from
``producer.client``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import redis
from celery import Celery
from celery.result import AsyncResult
from kombu.exceptions import OperationalError

from shared import schema, tenant_quota
from shared.errors import (
    FleetError,
    error_from_code,
    error_from_wire,
    error_to_wire,
    is_error_wire,
)
from shared.redis_refusal import BROKER_FAULTS, broker_unavailable, reason_of
from shared.schema import TaskEnvelope
from shared.tensor_wire import INLINE, SHM, is_wire
from shared.tensor_wire import iter_wires as tensor_wires

if TYPE_CHECKING:
    from shared.settings import Settings
    from shared.transport import ShmStore

__all__ = [
    "READY_STATES",
    "ResultHandle",
    "ResultReading",
    "Revocation",
    "outcome_from_meta",
    "resolve_tensors",
    "tensor_wires",
]


log = logging.getLogger("fleet.client")


RECONNECT_PAUSE_S = 0.2  # between attempts of a get() whose backend connection was lost


class Client(Protocol):
    """What a :class:`ResultHandle` needs of the client that made it
    (:class:`producer.client.FleetClient`)."""

    app: Celery

    def release_inputs(self, inputs: Any) -> int: ...
    def resolve(self, result: Any, release: bool = True) -> Any: ...


READY_STATES = frozenset({"SUCCESS", "FAILURE", "REVOKED"})


class ResultHandle:
    """A submitted request: its task ``id`` and a way to wait for its outcome."""

    def __init__(self, client: Client, task_id: str, envelope: TaskEnvelope) -> None:
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

        A connection to the result backend lost while waiting (a Redis restart, a Sentinel
        failover: Celery's result consumer raises the reset) is retried within ``timeout_s``,
        reconnecting (through Sentinel: to the new primary); the stored result is read first.

        Raises:
            TimeoutError: no result within ``timeout_s``.
            ConnectionError, redis.ConnectionError: the backend still unreachable at the end.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            res = AsyncResult(self.id, app=self.client.app)
            try:
                res.get(
                    timeout=max(deadline - time.monotonic(), 0.01),
                    propagate=False,
                    disable_sync_subtasks=False,
                )
                # the meta get() read and cached (Celery's decoding, as get_task_meta's): no
                # second read of the document
                return outcome_from_meta({"status": res.state, "result": res.result})
            except Exception as exc:  # celery.exceptions.TimeoutError is not a builtin one
                if type(exc).__name__ == "TimeoutError":
                    raise TimeoutError(f"no result for {self.id} within {timeout_s} s") from None
                if not _is_connection_error(exc) or time.monotonic() >= deadline:
                    raise
                log.warning("waiting for %s: result backend connection lost (%s); retrying",
                            self.id, exc)  # fmt: skip
                _reset_result_consumer(self.client.app)
                time.sleep(RECONNECT_PAUSE_S)

    def state(self) -> str:
        """Celery's state of the task right now (PENDING, SUCCESS, FAILURE, ...)."""
        return AsyncResult(self.id, app=self.client.app).state


def _is_connection_error(exc: BaseException) -> bool:
    """A lost or refused connection to Redis (redis-py's, the OS's, or kombu's wrapping)."""
    return isinstance(exc, redis.ConnectionError | ConnectionError | OperationalError)


def _reset_result_consumer(app: Celery) -> None:
    """Have the backend's result consumer reconnect its pubsub (Celery's own
    ``_reconnect_pubsub``: it re-reads the subscribed results, then subscribes afresh), so the
    next ``get()`` does not read the dead connection again. Best effort: Redis may still be
    away; the next ``get()`` then fails and is retried."""
    consumer = getattr(app.backend, "result_consumer", None)
    reconnect = getattr(consumer, "_reconnect_pubsub", None)
    if reconnect is not None:
        with contextlib.suppress(Exception):
            reconnect()


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
    if is_error_wire(res):  # raw JSON exception encoding
        code, msg, exc_type = error_from_wire(res)
        return {
            "error": {
                "code": code or "FLEET_ERROR",
                "message": "" if msg is None else msg,
                "type": exc_type,
            }
        }
    status = meta.get("status")
    return {
        "error": {"code": "FLEET_ERROR", "message": f"task ended {status}", "type": str(status)}
    }


class ResultReading:
    """Many requests' outcomes of a :class:`producer.client.FleetClient` (mixed into it):
    reads its ``app`` (the Celery app and its result backend) and ``settings``."""

    if TYPE_CHECKING:
        app: Celery
        settings: Settings

    def poll(self, handles: Sequence[ResultHandle]) -> list[dict[str, Any] | None]:
        """Read the outcomes of many requests in one round trip, without waiting.

        Returns, per handle, ``None`` while it has no result, else its outcome dict (see
        :meth:`ResultHandle.outcome`) with ``done_ms``: when the worker stored it (epoch ms).

        Raises:
            BrokerUnavailable: Redis could not be read (``reason``).
        """
        if not handles:
            return []
        backend = self.app.backend
        try:
            raw = backend.client.mget([backend.get_key_for_task(h.id) for h in handles])
        except BROKER_FAULTS as exc:
            if reason_of(exc) is None:
                raise
            raise broker_unavailable(exc, "could not read results") from exc
        out: list[dict[str, Any] | None] = []
        for value in raw:
            if value is None:
                out.append(None)
                continue
            meta = schema.decode_result(backend, value)
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

    def cancel(self, task_id: str, reason: str = "cancelled by its producer") -> bool:
        """Cancel a request that has no final result yet: it ends ``REVOKED``.

        No Lua (a producer's Redis user may not run scripts): one optimistic transaction.
        ``WATCH fleet:final:<id>``; if the marker is absent, ``MULTI``: the REVOKED document
        (Celery's result meta, the shape ``workers.batching.completion`` stores, with ``Revoked``'s
        exception encoding: code ``REVOKED``) with SETEX on the result key, the marker
        ``fleet:final:<id> 1`` (same TTL) claiming the request's one final result, and a
        PUBLISH on the result key (what Celery's result consumers and the gateway wait on);
        ``EXEC``. A worker's final write in between aborts the ``EXEC`` and the marker is read
        again. Workers check the marker before every batch and ack such a request unrun, and
        their own result write is first-wins on the same marker: a request still queued or
        held in a worker's prefetch window never runs. One whose batch was already running
        finishes computing, but its result is dropped (REVOKED stands).

        All or nothing: Redis applies a transaction whole once ``EXEC`` arrives, and refuses
        it whole (``EXECABORT``) when a command was refused as it was queued (an ACL rule,
        out of memory, a full disk, a read-only replica); a process that dies before ``EXEC``
        leaves nothing. A marker never stands without its document.

        Returns:
            True if this call cancelled it; False if it already had a final result (stored by
            a worker, or an earlier cancel). An id nobody submitted is cancelled too (True:
            REVOKED is stored for it): a queued request is a message in a Redis list, found
            by no id, so the client cannot tell it from an unknown one; the gateway's
            ``DELETE /v2/jobs/{id}`` knows its jobs and answers 404 for others.

        Raises:
            BrokerUnavailable: Redis refused the transaction (nothing applied; ``reason``) or
                could not be reached.
        """
        import redis

        backend = self.app.backend
        revoking = Revocation.of(self.app, self.settings, task_id, reason)
        try:
            with backend.client.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        pipe.watch(revoking.final)
                        if pipe.exists(revoking.final):
                            return False
                        pipe.multi()
                        for command in revoking.commands():
                            pipe.execute_command(*command)
                        pipe.execute()
                        return True
                    except redis.WatchError:
                        continue  # a final write landed meanwhile: read the marker again
        except BROKER_FAULTS as exc:
            if reason_of(exc) is None:
                raise
            raise broker_unavailable(exc, f"could not cancel {task_id}") from exc


class Revocation(NamedTuple):
    """What a producer's cancel writes (``FleetClient.cancel``, ``AsyncFleetClient.cancel``):
    the REVOKED document ``value`` under the result ``key``, the final marker ``final``, both
    for ``ttl`` seconds, and the release of ``task_id`` from the open sets ``releases`` of
    the tenants with ``max_queued`` (``shared.tenant_quota``), in one transaction that
    ``WATCH``es ``final``."""

    key: str
    final: str
    ttl: int
    value: bytes | str
    task_id: str = ""
    releases: tuple[str, ...] = ()

    @classmethod
    def of(cls, app: Celery, settings: Settings, task_id: str, reason: str) -> Revocation:
        """The revocation of ``task_id``: Celery's result meta (the shape
        ``workers.batching.completion`` stores) with ``Revoked``'s exception encoding (code
        ``REVOKED``), encoded by ``app``'s result backend."""
        from datetime import UTC, datetime

        from shared.errors import Revoked

        backend = app.backend
        meta = {
            "status": "REVOKED",
            "result": error_to_wire(Revoked(reason)),
            "traceback": None,
            "children": [],
            "date_done": datetime.now(UTC).isoformat(),
            "task_id": task_id,
        }
        ttl = int(settings.redis.result_expires_s)
        key = backend.get_key_for_task(task_id)
        releases = tuple(tenant_quota.open_key(n) for n in sorted(tenant_quota.limits(settings)))
        return cls(key, schema.final_key(task_id), ttl, backend.encode(meta), task_id, releases)

    def commands(self) -> list[tuple[Any, ...]]:
        """Inside ``MULTI``: the document (``SETEX``), the marker ``1`` claiming the one final
        result (same TTL), a ``PUBLISH`` of the document on the result key (what Celery's
        result consumers and the clients' subscriptions wait on), and an ``SREM`` of the id
        from every limited tenant's open set: the cancelled request no longer counts against
        its tenant's ``max_queued`` (the id is in one set at most: it is a fresh uuid4, or
        the caller's own; the worker's ``SREM`` when it drains the message removes nothing
        more). Every limited tenant's, because a cancel is by id alone: which tenant sent it
        is in its message, in a list, found by no id."""
        return [
            ("SETEX", self.key, self.ttl, self.value),
            ("SET", self.final, "1", "EX", self.ttl),
            ("PUBLISH", self.key, self.value),
            *(("SREM", key, self.task_id) for key in self.releases),
        ]


def _epoch_ms(date_done: Any) -> float | None:
    from datetime import datetime

    if isinstance(date_done, datetime):
        return date_done.timestamp() * 1000.0
    if isinstance(date_done, str):
        return datetime.fromisoformat(date_done).timestamp() * 1000.0
    return None


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
        if is_wire(obj, SHM):
            s = store()
            arr = s.get(obj)
            if release:
                s.release(obj)
            return arr
        if is_wire(obj, INLINE):
            from shared.transport import decode_inline

            return decode_inline(obj)
        return {k: resolve_tensors(v, store, release=release) for k, v in obj.items()}
    if isinstance(obj, list) and obj and isinstance(obj[0], dict | list):
        return [resolve_tensors(v, store, release=release) for v in obj]
    return obj
