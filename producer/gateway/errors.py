"""Error codes -> HTTP statuses, and the one error body the gateway answers with.

Every refusal and failure is ``{"error": <message>, "code": <CODE>}`` (OIP's error object
plus the fleet's stable code) with the one status :data:`STATUS_BY_CODE` gives its code.
Codes are the fleet's own (:mod:`shared.errors`) plus a few that only HTTP has
(:class:`GatewayError` subclasses below). An unknown code is answered 500 (a fault of the
fleet, never of the input: bad input always has a 4xx code).
"""

from __future__ import annotations

from typing import Any, ClassVar

# BrokerUnavailable: Redis unreachable or refusing a command while serving the request, the
# fleet's own class; its ``reason`` (OOM, MISCONF, READONLY, NOPERM, UNREACHABLE, ...) is
# answered in the body beside the code (``render.fleet_error_response``).
from shared.errors import BrokerUnavailable as BrokerUnavailable
from shared.errors import FleetError
from shared.errors import ModelNotFound as ModelNotFound  # 404: a model no modality serves

# One status per code. Documented in docs/gateway.md ("Status codes"); a unit test
# keeps the two and shared.errors in step.
STATUS_BY_CODE: dict[str, int] = {
    # the request is wrong: 400 (never retried)
    "INVALID_INPUT": 400,
    "UNSUPPORTED_MODALITY": 400,
    "INVALID_PRIORITY": 400,
    "IMAGE_DECODE": 400,
    "VIDEO_DECODE": 400,
    "INVALID_MESSAGE": 400,
    "ETA_NOT_SUPPORTED": 400,
    "TENSOR_REF_INVALID": 400,
    "UNAUTHORIZED": 401,
    "TENANT_FORBIDDEN": 403,
    "NOT_FOUND": 404,
    "MODEL_NOT_FOUND": 404,
    "METHOD_NOT_ALLOWED": 405,
    "REVOKED": 409,
    "ALREADY_FINAL": 409,
    "ID_CONFLICT": 409,
    "PAYLOAD_TOO_LARGE": 413,
    # refused up front, try again later: 429 with Retry-After
    "QUEUE_FULL": 429,
    "DEADLINE_UNREACHABLE": 429,
    "TENANT_QUOTA": 429,
    # the fleet's own faults: 5xx
    "FLEET_ERROR": 500,
    "MODEL_ERROR": 500,
    "DEVICE_ERROR": 500,
    "WORKER_LOST": 502,
    "TRANSPORT_ERROR": 502,
    "NO_READY_WORKER": 503,
    "CIRCUIT_OPEN": 503,
    "TRANSIENT": 503,
    "BROKER_UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
    "DEVICE_OOM": 507,
    "SHM_CAPACITY": 507,
}

RETRY_AFTER_CODES = frozenset(
    {
        "QUEUE_FULL",
        "DEADLINE_UNREACHABLE",
        "TENANT_QUOTA",
        "NO_READY_WORKER",
        "CIRCUIT_OPEN",
        "TRANSIENT",
        "BROKER_UNAVAILABLE",
    }
)


def status_for(code: str) -> int:
    """The HTTP status of an error code (500 for a code this table does not know)."""
    return STATUS_BY_CODE.get(code, 500)


def error_body(code: str, message: str, **extra: Any) -> dict[str, Any]:
    """The JSON error object: ``{"error": message, "code": code, **extra}``."""
    return {"error": message, "code": code, **extra}


class GatewayError(FleetError):
    """A refusal only HTTP has (unknown route or job, bad token). ``retry_after_s`` is sent
    as ``Retry-After`` when set."""

    code: ClassVar[str] = "FLEET_ERROR"

    def __init__(self, message: str = "", retry_after_s: int | None = None, **extra: Any):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.extra = extra


class Unauthorized(GatewayError):
    code = "UNAUTHORIZED"


class NotFound(GatewayError):
    code = "NOT_FOUND"


class AlreadyFinal(GatewayError):
    """DELETE of a job that has its final result already (``extra`` carries its state)."""

    code = "ALREADY_FINAL"


class IdConflict(GatewayError):
    """The request's id (or Idempotency-Key) already names a job of another model, or of a
    different request (``producer.gateway.fingerprint``)."""

    code = "ID_CONFLICT"


class TenantForbidden(GatewayError):
    """The bearer token is bound to a tenant and the request names another
    (``producer.gateway.tenancy``)."""

    code = "TENANT_FORBIDDEN"
