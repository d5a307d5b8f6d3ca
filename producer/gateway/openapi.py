"""Schemas for ``/openapi.json`` (documentation only: handlers parse bodies themselves, since
a binary-extension body is not JSON). Names and fields follow OIP v2 REST."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Param = str | int | float | bool


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorBody(_Doc):
    error: str = Field(description="what went wrong")
    code: str = Field(description="the stable error code (docs/gateway.md, status codes)")
    reason: str | None = Field(
        default=None,
        description="BROKER_UNAVAILABLE only: OOM, MISCONF, READONLY, NOPERM, UNREACHABLE, REFUSED",
    )


class RequestInput(_Doc):
    name: str
    shape: list[int] = Field(description="dimensions, each >= 0")
    datatype: Literal[
        "BOOL",
        "UINT8",
        "UINT16",
        "UINT32",
        "UINT64",
        "INT8",
        "INT16",
        "INT32",
        "INT64",
        "FP16",
        "FP32",
        "FP64",
        "BYTES",
    ]
    parameters: dict[str, Param] | None = Field(
        default=None, description="binary_data_size: the input's bytes after the JSON header"
    )
    data: list[Any] | None = Field(
        default=None,
        description="row-major, flat or nested; BYTES elements are strings (media: base64)",
    )


class RequestOutput(_Doc):
    name: str
    parameters: dict[str, Param] | None = Field(
        default=None, description="binary_data: true returns this output as raw bytes"
    )


class InferenceRequest(_Doc):
    id: str | None = Field(
        default=None, description="becomes the job id; a repeated id returns the same job"
    )
    parameters: dict[str, Param] | None = Field(
        default=None,
        description="priority (1 = realtime, 2 = high, 0/3 = normal, >= 4 = bulk), timeout "
        "(microseconds: the deadline), binary_data_output, top_k (labelled models: how many "
        "labels, best first)",
    )
    inputs: list[RequestInput] = Field(min_length=1)
    outputs: list[RequestOutput] | None = None


class ResponseOutput(_Doc):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Param] | None = None
    data: list[Any] | None = Field(default=None, description="numbers; BYTES: strings")


class InferenceResponse(_Doc):
    model_name: str
    model_version: str | None = None
    id: str
    parameters: dict[str, Param] | None = None
    outputs: list[ResponseOutput]


class Progress(_Doc):
    done: int | None = None
    total: int | None = None


class JobView(_Doc):
    id: str
    model: str
    modality: str
    priority: str
    state: Literal["PENDING", "PROGRESS", "SUCCESS", "FAILURE", "REVOKED"]
    created_ms: float
    deadline_ms: float | None = None
    location: str
    progress: Progress | None = None
    result: InferenceResponse | None = None
    error: ErrorBody | None = None


class TensorMeta(_Doc):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(_Doc):
    name: str
    versions: list[str] | None = None
    platform: str
    inputs: list[TensorMeta]
    outputs: list[TensorMeta]
    parameters: dict[str, Param] | None = Field(
        default=None,
        description="modality, kind, weights (where they come from), top_k and max_top_k "
        "(labelled models), max_texts (xmodal), a folder's model_type and architectures",
    )


class ServerMetadata(_Doc):
    name: str
    version: str
    extensions: list[str]


class Live(_Doc):
    live: bool


class Ready(_Doc):
    live: bool
    ready: bool
    models: dict[str, bool] | None = None


class ModelReady(_Doc):
    name: str
    ready: bool


def err(description: str) -> dict[str, Any]:
    return {"description": description, "model": ErrorBody}


AUTH = {401: err("missing or wrong bearer token (UNAUTHORIZED)")}
BROKER = {
    503: err("Redis unreachable or refusing (BROKER_UNAVAILABLE, with a reason) or no live worker")
}

INFER_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the result (also for a repeated POST of a finished job, "
        "Prefer: respond-async or not)",
        "model": InferenceResponse,
    },
    202: {
        "description": "accepted, not final yet: poll Location (/v2/jobs/{id}); the body is "
        "the job's state now (PENDING, PROGRESS)",
        "model": JobView,
    },
    400: err("invalid input (INVALID_INPUT, INVALID_PRIORITY, IMAGE_DECODE, ...)"),
    **AUTH,
    404: err("unknown model (MODEL_NOT_FOUND)"),
    409: err("the id names another model's or request's job (ID_CONFLICT), or REVOKED"),
    413: err("too large (PAYLOAD_TOO_LARGE)"),
    429: err("QUEUE_FULL or DEADLINE_UNREACHABLE; see Retry-After"),
    500: err("a model fault (MODEL_ERROR, FLEET_ERROR)"),
    502: err("WORKER_LOST, TRANSPORT_ERROR"),
    **BROKER,
    504: err("the deadline passed before it could run (DEADLINE_EXCEEDED)"),
    507: err("DEVICE_OOM, SHM_CAPACITY"),
}

INFER_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": InferenceRequest.model_json_schema()},
            "application/octet-stream": {
                "schema": {
                    "type": "string",
                    "format": "binary",
                    "description": "JSON header (Inference-Header-Content-Length bytes), "
                    "then each binary input's bytes",
                }
            },
        },
    },
    "parameters": [
        {
            "name": "Prefer",
            "in": "header",
            "required": False,
            "schema": {"type": "string"},
            "description": "respond-async, wait=N (seconds)",
        },
        {
            "name": "Idempotency-Key",
            "in": "header",
            "required": False,
            "schema": {"type": "string"},
            "description": "the job id (instead of the body's id)",
        },
        {
            "name": "Inference-Header-Content-Length",
            "in": "header",
            "required": False,
            "schema": {"type": "integer"},
            "description": "binary extension: the JSON's length",
        },
    ],
}
