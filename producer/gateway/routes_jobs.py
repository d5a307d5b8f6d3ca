"""The gateway's job routes: ``GET /v2/jobs/{id}`` (state, progress, result), ``DELETE``
(cancel: 200 REVOKED, 409 ALREADY_FINAL) and ``/events`` (the same as Server-Sent Events).

Registered by :func:`producer.gateway.app.create_app`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

from producer.gateway import openapi as doc
from producer.gateway.errors import AlreadyFinal, NotFound
from producer.gateway.events import job_events as event_stream
from producer.gateway.jobs import Snapshot
from producer.gateway.params import check_request_id
from producer.gateway.render import job_view, json_response

if TYPE_CHECKING:
    from producer.gateway.state import Gateway

__all__ = ["add_job_routes", "job_body", "job_snapshot"]


async def job_snapshot(gw: Gateway, job_id: str) -> Snapshot:
    """The job's state now.

    Raises:
        InvalidInput: a malformed id. NotFound: no such job (unknown, or expired).
    """
    check_request_id(job_id, "the job id")
    snap = await gw.service().snapshot(job_id)
    if snap is None:
        raise NotFound(f"no job {job_id!r} (unknown, or expired)")
    return snap


async def job_body(gw: Gateway, snap: Snapshot) -> dict[str, Any]:
    """The JSON view of a job; a succeeded one with its result (its inputs are released)."""
    spec = gw.models.get(snap.job.model)
    result = None
    if snap.state == "SUCCESS" and snap.meta is not None:
        result = await gw.service().resolve(snap.meta.get("result") or {})
        await gw.service()._release(snap.job.input_refs)
    return job_view(snap, spec, result)


def add_job_routes(app: FastAPI, gw: Gateway, secured: list[Any]) -> None:
    """``GET``/``DELETE /v2/jobs/{job_id}`` and ``GET /v2/jobs/{job_id}/events``."""
    job_responses = {**doc.AUTH, 404: doc.err("no such job (NOT_FOUND)"), **doc.BROKER}
    common: dict[str, Any] = {"tags": ["jobs"], "dependencies": secured}

    @app.get("/v2/jobs/{job_id}", response_model=doc.JobView, responses=job_responses, **common)
    async def get_job(job_id: str) -> Response:
        return json_response(await job_body(gw, await job_snapshot(gw, job_id)))

    @app.delete(
        "/v2/jobs/{job_id}",
        response_model=doc.JobView,
        responses={**job_responses, 409: doc.err("final already (ALREADY_FINAL)")},
        **common,
    )
    async def cancel_job(job_id: str) -> Response:
        """Cancel: 200 with the REVOKED job; 409 ALREADY_FINAL (with its ``state``) when it had
        its final result already (a second DELETE included)."""
        snap = await job_snapshot(gw, job_id)
        if not snap.final and await gw.service().cancel(job_id):
            return json_response(await job_body(gw, await job_snapshot(gw, job_id)))
        snap = await job_snapshot(gw, job_id)
        raise AlreadyFinal(f"job {job_id} is final already ({snap.state})", state=snap.state)

    events_responses = {200: {"description": "text/event-stream: state, progress, final"}}

    @app.get("/v2/jobs/{job_id}/events", responses={**events_responses, **job_responses}, **common)
    async def job_events(job_id: str, request: Request) -> Response:
        snap = await job_snapshot(gw, job_id)
        view = functools.partial(job_body, gw)
        return StreamingResponse(
            event_stream(gw.service(), snap, request, gw.settings.gateway, view),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
