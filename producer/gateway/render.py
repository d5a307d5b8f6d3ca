"""HTTP answers: JSON bodies, inference responses, job views, errors.

Statuses come from :mod:`producer.gateway.errors`; this module only shapes bodies and
headers.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

from producer.gateway.codec import OutputTensor, encode_response
from producer.gateway.errors import RETRY_AFTER_CODES, error_body, status_for
from producer.gateway.jobs import Job, Snapshot, error_of
from producer.gateway.models import ModelSpec, outputs_from_result, result_parameters
from shared.errors import BrokerUnavailable, FleetError


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    body = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def error_response(
    code: str, message: str, retry_after_s: int | None = None, **extra: Any
) -> Response:
    """``{"error", "code", ...}`` at the code's status; ``Retry-After`` on retryable codes."""
    headers = {"Retry-After": str(retry_after_s or 1)} if code in RETRY_AFTER_CODES else None
    return json_response(error_body(code, message, **extra), status_for(code), headers)


def fleet_error_response(exc: FleetError, default_retry_s: int) -> Response:
    """``exc``'s error body (with its ``extra``, and a ``BrokerUnavailable``'s ``reason``)."""
    extra = dict(getattr(exc, "extra", None) or {})
    if isinstance(exc, BrokerUnavailable):
        extra["reason"] = exc.reason
    retry = getattr(exc, "retry_after_s", None) or default_retry_s
    return error_response(exc.code, exc.message, retry, **extra)


def location(job_id: str) -> str:
    return f"/v2/jobs/{job_id}"


def infer_header(spec: ModelSpec, job: Job, request_id: str | None, result: dict[str, Any]):
    """The inference response's fields besides ``outputs``."""
    params = {"job_id": job.id, "priority": job.priority, **result_parameters(spec, result)}
    return {
        "model_name": spec.name,
        "model_version": spec.version,
        "id": request_id if request_id is not None else job.id,
        "parameters": params,
    }


def infer_response(
    spec: ModelSpec,
    job: Job,
    request_id: str | None,
    result: dict[str, Any],
    names: list[str],
    binary: set[str],
) -> Response:
    """200 with the requested outputs (JSON ``data`` or binary after the JSON header)."""
    by_name = {o.name: o for o in outputs_from_result(spec, result)}
    outputs: list[OutputTensor] = [by_name[n] for n in names]
    body, header_len = encode_response(infer_header(spec, job, request_id, result), outputs, binary)
    if header_len is None:
        return Response(body, media_type="application/json")
    return Response(
        body,
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(header_len)},
    )


def infer_json(spec: ModelSpec, job: Job, result: dict[str, Any]) -> dict[str, Any]:
    """The inference response as a JSON object (every output as ``data``), for job views."""
    outs = outputs_from_result(spec, result)
    body, _ = encode_response(infer_header(spec, job, None, result), outs, set())
    return json.loads(body)


def job_view(snap: Snapshot, spec: ModelSpec | None, result: Any = None) -> dict[str, Any]:
    """A job as ``GET /v2/jobs/{id}`` shows it: state, progress, and the result or error
    once final (``result``: the resolved success result, when ``SUCCESS``)."""
    job = snap.job
    out: dict[str, Any] = {
        "id": job.id,
        "model": job.model,
        "modality": job.modality,
        "priority": job.priority,
        "state": snap.state,
        "created_ms": job.created_ms,
        "deadline_ms": job.deadline_ms,
        "location": location(job.id),
    }
    if snap.progress is not None:
        out["progress"] = {
            "done": snap.progress.get("done"),
            "total": snap.progress.get("total"),
        }
    if snap.meta is not None and snap.state == "SUCCESS" and spec is not None:
        out["result"] = infer_json(spec, job, result if result is not None else {})
    elif snap.meta is not None and snap.state in ("FAILURE", "REVOKED"):
        code, message = error_of(snap.meta)
        out["error"] = error_body(code, message)
    return out


def accepted(view: dict[str, Any], prefer_async: bool) -> Response:
    """202 with the job's ``Location``."""
    headers = {"Location": view["location"]}
    if prefer_async:
        headers["Preference-Applied"] = "respond-async"
    return json_response(view, 202, headers)
