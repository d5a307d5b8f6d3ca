"""The gateway's inference routes: ``POST /v2/models/{model}[/versions/{version}]/infer``.

A request is parsed (JSON, or Triton's binary extension), submitted as a job, and answered
with its result when it comes within the wait budget (``Prefer: wait=N``, the deadline,
``[gateway] default_wait_s``), else ``202`` with the job's ``Location`` and its state now;
``Prefer: respond-async`` answers ``202`` at once. A repeated POST (the same ``id`` or
``Idempotency-Key``) of a job that is final answers its outcome as a synchronous request
would, ``respond-async`` or not (nothing is left to wait for: the preference is not applied).
A repeated id names the same job only for the same request (``jobs.same_request``: the
model and the content's fingerprint, ``producer.gateway.fingerprint``); any other request
with it is refused ``ID_CONFLICT``. Registered by :func:`producer.gateway.app.create_app`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from producer.gateway import openapi as doc
from producer.gateway.codec import binary_output_names, parse_infer_request
from producer.gateway.jobs import WAIT_GRACE_S, Snapshot
from producer.gateway.models import ModelSpec
from producer.gateway.params import (
    check_request_id,
    parse_prefer,
    priority_class,
    timeout_seconds,
    wait_budget,
)
from producer.gateway.render import accepted, error_response, infer_response, job_view
from producer.gateway.tenancy import TENANT_HEADER, request_tenant
from shared.errors import PayloadTooLarge

if TYPE_CHECKING:
    from producer.gateway.state import Gateway

__all__ = ["add_infer_routes", "read_body", "run_infer"]


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with PAYLOAD_TOO_LARGE past ``limit`` bytes (checked on
    Content-Length first, then while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(
            f"the body is {int(declared):,} bytes; the limit is {limit:,} bytes "
            "([gateway] max_body_bytes)"
        )
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(
                f"the body is over the limit of {limit:,} bytes ([gateway] max_body_bytes)"
            )
        parts.append(chunk)
    return b"".join(parts)


def _task_id(request: Request, req_id: str | None) -> str | None:
    """The job's id: ``Idempotency-Key``, else the request's ``id``, else none (a fresh one).

    Raises:
        InvalidInput: a malformed id.
    """
    key = request.headers.get("idempotency-key")
    if key is not None:
        return check_request_id(key, "Idempotency-Key")
    if req_id is not None:
        return check_request_id(req_id)
    return None


async def run_infer(gw: Gateway, spec: ModelSpec, request: Request) -> Response:
    """Submit one inference request to ``spec`` and answer it (see the module docstring).

    Raises:
        FleetError: a refused request (bad input, QUEUE_FULL, DEADLINE_UNREACHABLE, ...),
            rendered by the app's handler.
    """
    settings, jobs = gw.settings, gw.service()
    retry_s = settings.gateway.retry_after_s
    body = await read_body(request, settings.gateway.max_body_bytes)
    req = parse_infer_request(body, request.headers.get("inference-header-content-length"))
    names, binary = binary_output_names(req, spec.output_names)
    priority = priority_class(req.parameters.get("priority"))
    timeout_s = timeout_seconds(req.parameters.get("timeout"))
    prefer = parse_prefer(request.headers.getlist("prefer"))
    task_id = _task_id(request, req.id)
    tenant = request_tenant(
        getattr(request.state, "bound_tenant", None),
        request.headers.get(TENANT_HEADER),
        req.parameters.get("tenant"),
    )
    job, created = await jobs.submit(
        spec, req.inputs, priority, timeout_s, task_id, len(body), req.parameters, tenant
    )
    if prefer.respond_async:
        # a new job is queued; a repeated one may be running or final already
        snap = Snapshot(job, None) if created else await jobs.current(job)
        if not snap.final:
            return accepted(job_view(snap, spec), True)
        meta = snap.meta
    else:
        left_s = None
        if job.deadline_ms is not None:
            left_s = max(0.0, (job.deadline_ms - jobs.client.clock.peek() * 1000.0) / 1000.0)
        wait_s = wait_budget(
            prefer, left_s, settings.gateway.default_wait_s, settings.gateway.max_wait_s
        )
        if prefer.wait_s is None:  # a result stored right at the deadline still makes it
            wait_s += WAIT_GRACE_S
        meta = await jobs.wait(job, wait_s)
        if meta is None:
            snap = await jobs.current(job)  # PENDING, or a video's PROGRESS
            if not snap.final:
                return accepted(job_view(snap, spec), False)
            meta = snap.meta
    assert meta is not None  # final
    if meta.get("status") != "SUCCESS":
        view = job_view(Snapshot(job, meta), spec)
        err = view["error"]
        return error_response(err["code"], err["error"], retry_s, id=job.id)
    result = await jobs.resolve(meta.get("result") or {})
    return infer_response(spec, job, req.id, result, names, binary)


def add_infer_routes(app: FastAPI, gw: Gateway, secured: list[Any]) -> None:
    """``POST /v2/models/{model}/infer`` and ``.../versions/{version}/infer``."""
    infer_doc: dict[str, Any] = {
        "tags": ["inference"],
        "dependencies": secured,
        "responses": doc.INFER_RESPONSES,
        "openapi_extra": doc.INFER_BODY,
    }

    @app.post("/v2/models/{model}/infer", **infer_doc)
    async def infer(model: str, request: Request) -> Response:
        return await run_infer(gw, gw.model(model), request)

    @app.post("/v2/models/{model}/versions/{version}/infer", **infer_doc)
    async def infer_version(model: str, version: str, request: Request) -> Response:
        return await run_infer(gw, gw.model(model, version), request)
