"""The product's error hierarchy, each error with a stable string code.

One root, :class:`FleetError`, with a branch per failure domain (input, transport, deadline,
device, model, queue). The ``code`` is part of the public contract: it travels in the task
result (``exc_message[1]`` of Celery's JSON exception encoding, and ``error.code`` in the
client's result dict) and must never change once released. Adding codes is fine.

The error wire form (what a FAILURE or REVOKED result document holds) is encoded by
:func:`error_to_wire` and read by :func:`error_from_wire`, on both sides.

Retry policy is decided by the class: only :class:`TransientError` subclasses are retried.
Bad input is never retried.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

__all__ = [
    "ERROR_CLASSES",
    "BrokerUnavailable",
    "CircuitOpen",
    "DeadlineExceeded",
    "DeadlineUnreachable",
    "DeviceError",
    "DeviceOOM",
    "EtaNotSupported",
    "FleetError",
    "ImageDecodeError",
    "InvalidInput",
    "InvalidMessage",
    "InvalidPriority",
    "ModelError",
    "ModelNotFound",
    "NoReadyWorker",
    "PayloadTooLarge",
    "QueueFull",
    "Revoked",
    "ShmCapacityError",
    "TenantQuota",
    "TensorRefError",
    "TransientError",
    "TransportError",
    "UnsupportedModality",
    "VideoDecodeError",
    "WireError",
    "WorkerLost",
    "error_from_code",
    "error_from_wire",
    "error_to_wire",
    "is_error_wire",
]


class FleetError(Exception):
    """Root of every error the fleet raises on purpose.

    Args:
        message: human-readable explanation, safe to show to a caller (never contains tensors
            or secrets).
        code: overrides the class's stable code; only used when an error is rebuilt from a
            stored result whose class is unknown to this process.

    The exception's ``args`` are ``(message, code)`` so that Celery's JSON exception encoding
    (``exc_type``, ``exc_message``, ``exc_module``) carries the code to clients in any language.
    """

    code: ClassVar[str] = "FLEET_ERROR"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str = "", code: str | None = None) -> None:
        self.message = message
        if code is not None and code != type(self).code:
            self.code = code  # type: ignore[misc]  # instance override for rebuilt errors
        super().__init__(message, self.code)

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"

    def to_dict(self) -> dict[str, Any]:
        """The error as the JSON object a client sees: ``{"code", "message", "type"}``."""
        return {"code": self.code, "message": self.message, "type": type(self).__name__}


class InvalidInput(FleetError):
    """The request itself is wrong (schema, empty text, undecodable bytes). Never retried."""

    code = "INVALID_INPUT"


class UnsupportedModality(InvalidInput):
    code = "UNSUPPORTED_MODALITY"


class ModelNotFound(InvalidInput):
    """The request names a model (or a version of one) its modality does not serve: no
    ``[models.<name>]`` table of the modality's ``model``/``models`` answers to it."""

    code = "MODEL_NOT_FOUND"


class InvalidPriority(InvalidInput):
    code = "INVALID_PRIORITY"


class PayloadTooLarge(InvalidInput):
    """An input above a configured size limit (bytes, characters or pixels)."""

    code = "PAYLOAD_TOO_LARGE"


class ImageDecodeError(InvalidInput):
    code = "IMAGE_DECODE"


class VideoDecodeError(InvalidInput):
    code = "VIDEO_DECODE"


class InvalidMessage(InvalidInput):
    """The message itself is malformed (not Celery's ``[args, kwargs, embed]`` body, bad
    headers): no request could be read from it. Acked; never retried."""

    code = "INVALID_MESSAGE"


class Revoked(FleetError):
    """The request was revoked (``celery control revoke``, Flower) before it ran."""

    code = "REVOKED"


class EtaNotSupported(InvalidInput):
    """An ETA or countdown: inference requests run as soon as possible or not at all."""

    code = "ETA_NOT_SUPPORTED"


class DeadlineExceeded(FleetError):
    """The request's deadline passed before it could run; it was not run."""

    code = "DEADLINE_EXCEEDED"


class QueueFull(FleetError):
    """Backpressure: the modality/priority queue is at its configured maximum length."""

    code = "QUEUE_FULL"


class TenantQuota(FleetError):
    """Backpressure per tenant: the request's tenant already has ``[tenants.<name>]
    max_queued`` requests queued or running (``shared.tenants``). Refused at submit; nothing
    was sent."""

    code = "TENANT_QUOTA"


class DeadlineUnreachable(FleetError):
    """Refused up front: the queue ahead of the request, at the measured service rate, would
    take longer to drain than the time left before its deadline (the HTTP gateway's admission
    control; only decided when a rate was measured). Not sent, so nothing ran."""

    code = "DEADLINE_UNREACHABLE"


class NoReadyWorker(FleetError):
    """Refused up front: no live worker serves the requested model right now."""

    code = "NO_READY_WORKER"


class TransportError(FleetError):
    """Tensor transport (shared memory or inline bytes) failed."""

    code = "TRANSPORT_ERROR"


class ShmCapacityError(TransportError):
    code = "SHM_CAPACITY"


class TensorRefError(TransportError):
    """A TensorRef is malformed, unknown or expired."""

    code = "TENSOR_REF_INVALID"


class TransientError(FleetError):
    """A fault that may pass (a worker lost, a broker hiccup). Retried with backoff."""

    code = "TRANSIENT"
    retryable = True


class BrokerUnavailable(FleetError):
    """Redis did not take a producer's call: it is unreachable, or it answered and refused.

    ``reason`` says which, so that a caller can tell a fault that needs an operator from a
    lost connection: ``OOM`` (``maxmemory`` reached under ``noeviction``), ``MISCONF`` (it
    cannot persist: the disk under its AOF or RDB is full or failing), ``READONLY`` (the node
    is a replica), ``NOPERM`` (an ACL rule denies the command), ``AUTH`` (Redis refused the
    credentials: a wrong user or password), ``NOT_REDIS`` (the address answers, but not as
    Redis: another service's port), ``UNREACHABLE`` (no connection, a timeout, a node still
    loading), ``REFUSED`` (another refusal). Nothing was
    sent, except where a connection was lost after a publish went out (the request may be
    queued: retry with the same id). Never stored in a result: producers raise it.
    """

    code = "BROKER_UNAVAILABLE"
    # Redis answered and refused to write: what pauses a worker (``workers.batching.refusals``)
    REFUSALS: ClassVar[tuple[str, ...]] = ("OOM", "MISCONF", "READONLY", "NOPERM")
    # Neither passes by waiting: a producer reports them at once, without retrying
    MISCONFIGURED: ClassVar[tuple[str, ...]] = ("AUTH", "NOT_REDIS")
    REASONS: ClassVar[tuple[str, ...]] = (*REFUSALS, *MISCONFIGURED, "UNREACHABLE", "REFUSED")

    def __init__(
        self, message: str = "", code: str | None = None, reason: str = "UNREACHABLE"
    ) -> None:
        super().__init__(message, code)
        self.reason = reason

    def to_dict(self) -> dict[str, Any]:
        """As :meth:`FleetError.to_dict`, with the ``reason``."""
        return {**super().to_dict(), "reason": self.reason}


class WorkerLost(FleetError):
    """A message was redelivered too often because its worker died on it (a poison message)."""

    code = "WORKER_LOST"


class ModelError(FleetError):
    """The model raised while running a request that passed validation."""

    code = "MODEL_ERROR"


class CircuitOpen(ModelError):
    code = "CIRCUIT_OPEN"


class DeviceError(FleetError):
    code = "DEVICE_ERROR"


class DeviceOOM(DeviceError):
    """A single request does not fit in the worker's memory partition."""

    code = "DEVICE_OOM"


def _all_subclasses(cls: type[FleetError]) -> list[type[FleetError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


ERROR_CLASSES: dict[str, type[FleetError]] = {c.code: c for c in _all_subclasses(FleetError)}
"""Stable code -> class, for rebuilding errors read from a result backend."""


def error_from_code(code: str, message: str) -> FleetError:
    """Rebuild an error from its stable code; unknown codes give a plain :class:`FleetError`."""
    cls = ERROR_CLASSES.get(code, FleetError)
    return cls(message, code=code)


class WireError(NamedTuple):
    """What an error's wire form says: ``code`` and ``message`` are ``None`` where the form
    carries none (an exception from outside the fleet's hierarchy, an exception without
    args); ``type`` is the exception's class name (``exc_type``, ``""`` if absent)."""

    code: str | None
    message: str | None
    type: str


def error_to_wire(err: FleetError) -> dict[str, Any]:
    """The error's wire form: Celery's JSON encoding of an exception with the fleet's code,
    ``{"exc_type": "ImageDecodeError", "exc_message": ["<message>", "IMAGE_DECODE"],
    "exc_module": "shared.errors"}``; Celery, Flower and clients in any language read it."""
    return {
        "exc_type": type(err).__name__,
        "exc_message": [err.message, err.code],
        "exc_module": type(err).__module__,
    }


def is_error_wire(obj: object) -> bool:
    """True when ``obj`` is an exception's wire form (a dict with ``exc_message``)."""
    return isinstance(obj, dict) and "exc_message" in obj


def error_from_wire(wire: Mapping[str, Any]) -> WireError:
    """Read an exception's wire form (see :func:`error_to_wire`); never raises.

    ``exc_message`` other than a list is taken as its one arg; a code that is not a string
    is no code.
    """
    args = wire.get("exc_message") or []
    if not isinstance(args, list):
        args = [args]
    code = args[1] if len(args) > 1 and isinstance(args[1], str) else None
    message = str(args[0]) if args else None
    return WireError(code, message, str(wire.get("exc_type", "")))
