"""The gateway's ASGI app: OIP v2 REST routes, async jobs, SSE, cancellation.

Routes (every one needs ``Authorization: Bearer <token>`` except ``/v2/health/live``)::

    GET    /v2                                   server metadata
    GET    /v2/health/live | /v2/health/ready    liveness (no auth) | readiness
    GET    /v2/models/{m}[/versions/{v}]         model metadata
    GET    /v2/models/{m}[/versions/{v}]/ready   model readiness (a live worker serves it)
    POST   /v2/models/{m}[/versions/{v}]/infer   inference (sync, or 202 + Location)
    GET    /v2/jobs/{id}                         a job's state, progress, result
    GET    /v2/jobs/{id}/events                  the same as Server-Sent Events
    DELETE /v2/jobs/{id}                         cancel (200 REVOKED, 409 ALREADY_FINAL)
    GET    /openapi.json                         this API's OpenAPI schema

Build with :func:`create_app`; ``fleet gateway`` serves it with uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse

from producer.gateway import openapi as doc
from producer.gateway.auth import check_bearer
from producer.gateway.codec import binary_output_names, parse_infer_request
from producer.gateway.errors import AlreadyFinal, IdConflict, ModelNotFound, NotFound
from producer.gateway.events import job_events as event_stream
from producer.gateway.jobs import WAIT_GRACE_S, JobService, Snapshot
from producer.gateway.models import VERSION, ModelSpec, model_specs
from producer.gateway.params import (
    check_request_id,
    parse_prefer,
    priority_class,
    timeout_seconds,
    wait_budget,
)
from producer.gateway.render import (
    accepted,
    error_response,
    fleet_error_response,
    infer_response,
    job_view,
    json_response,
)
from shared.errors import FleetError, PayloadTooLarge
from shared.settings import Settings

log = logging.getLogger("fleet.gateway")
SERVER_NAME = "mmfleet"
EXTENSIONS = ["binary_tensor_data", "async_jobs", "server_sent_events", "cancellation"]


class Gateway:
    """The app's state: settings, token, models and the job service (built at start-up)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.token = settings.gateway_token()
        self.models: dict[str, ModelSpec] = model_specs(settings)
        self.jobs: JobService | None = None

    async def start(self) -> None:
        from producer.client import FleetClient
        from shared.redis_client import async_redis_client

        client = FleetClient(self.settings)
        # The producer's own credentials, as its Celery app.
        redis = async_redis_client(self.settings, client.role, max_connections=64)
        self.jobs = JobService(client, redis, self.models)
        await self.jobs.start()

    async def stop(self) -> None:
        if self.jobs is not None:
            await self.jobs.stop()
            await self.jobs.redis.aclose()
            await self.jobs.redis.connection_pool.disconnect()
            await asyncio.get_running_loop().run_in_executor(None, self.jobs.client.close)

    def service(self) -> JobService:
        assert self.jobs is not None, "the gateway has not started"
        return self.jobs

    def model(self, name: str, version: str | None = None) -> ModelSpec:
        spec = self.models.get(name)
        if spec is None or (version is not None and version != VERSION):
            known = ", ".join(sorted(self.models))
            what = f"model {name!r}" + (f" version {version!r}" if version is not None else "")
            raise ModelNotFound(f"unknown {what}; served: {known} (version {VERSION})")
        return spec


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with PAYLOAD_TOO_LARGE past ``limit`` bytes (checked on
    Content-Length first, then while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the body is {int(declared):,} bytes; the limit is {limit:,}")
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the body is over the limit of {limit:,} bytes")
        parts.append(chunk)
    return b"".join(parts)


def create_app(settings: Settings) -> FastAPI:
    """The gateway app for ``settings`` (Redis connections open at start-up)."""
    gw = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    app = FastAPI(
        title="mmfleet gateway",
        version="0.1.0",
        description="Open Inference Protocol v2 REST over the mmfleet worker fleet.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.gateway = gw
    retry_s = settings.gateway.retry_after_s

    async def auth(request: Request) -> None:  # async: FastAPI runs a sync one on a thread
        check_bearer(request.headers.get("authorization"), gw.token)

    secured = [Depends(auth)]

    @app.exception_handler(FleetError)
    async def _fleet_error(_r: Request, exc: FleetError) -> Response:
        return fleet_error_response(exc, retry_s)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_r: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}.get(exc.status_code, "INVALID_INPUT")
        return error_response(code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_r: Request, exc: RequestValidationError) -> Response:
        return error_response("INVALID_INPUT", f"invalid request: {exc.errors()[:3]}")

    @app.exception_handler(Exception)
    async def _unexpected(_r: Request, exc: Exception) -> Response:
        from redis.exceptions import RedisError

        if isinstance(exc, RedisError | ConnectionError):
            return error_response("BROKER_UNAVAILABLE", f"Redis: {exc}", retry_s)
        log.exception("unexpected error")
        return error_response("FLEET_ERROR", f"internal error ({type(exc).__name__})")

    # -- server ---------------------------------------------------------------------------
    @app.get("/v2/health/live", response_model=doc.Live, tags=["health"])
    async def live() -> Response:
        return json_response({"live": True})

    @app.get(
        "/v2/health/ready",
        response_model=doc.Ready,
        tags=["health"],
        dependencies=secured,
        responses={**doc.AUTH, **doc.BROKER},
    )
    async def ready() -> Response:
        """Ready when Redis answers and at least one model has a live worker."""
        jobs = gw.service()
        await jobs.redis.ping()
        models = {n: bool(await jobs.live_workers(s.modality)) for n, s in gw.models.items()}
        body = {"live": True, "ready": any(models.values()), "models": models}
        if body["ready"]:
            return json_response(body)
        return error_response("NO_READY_WORKER", "no model has a live worker", retry_s, **body)

    @app.get(
        "/v2",
        response_model=doc.ServerMetadata,
        tags=["server"],
        dependencies=secured,
        responses=doc.AUTH,
    )
    async def server_metadata() -> Response:
        return json_response({"name": SERVER_NAME, "version": "0.1.0", "extensions": EXTENSIONS})

    @app.get("/openapi.json", include_in_schema=False, dependencies=secured)
    async def openapi_schema() -> Response:
        return json_response(app.openapi())

    # -- models ---------------------------------------------------------------------------
    meta_responses = {**doc.AUTH, 404: doc.err("unknown model (MODEL_NOT_FOUND)")}

    @app.get(
        "/v2/models/{model}",
        response_model=doc.ModelMetadata,
        tags=["models"],
        dependencies=secured,
        responses=meta_responses,
    )
    async def model_metadata(model: str) -> Response:
        return json_response(gw.model(model).metadata())

    @app.get(
        "/v2/models/{model}/versions/{version}",
        response_model=doc.ModelMetadata,
        tags=["models"],
        dependencies=secured,
        responses=meta_responses,
    )
    async def model_version_metadata(model: str, version: str) -> Response:
        return json_response(gw.model(model, version).metadata())

    async def _model_ready(spec: ModelSpec) -> Response:
        nodes = await gw.service().live_workers(spec.modality)
        if nodes:
            return json_response({"name": spec.name, "ready": True})
        return error_response(
            "NO_READY_WORKER",
            f"no live {spec.modality} worker",
            retry_s,
            name=spec.name,
            ready=False,
        )

    ready_responses = {**meta_responses, 503: doc.err("no live worker (NO_READY_WORKER)")}

    @app.get(
        "/v2/models/{model}/ready",
        response_model=doc.ModelReady,
        tags=["models"],
        dependencies=secured,
        responses=ready_responses,
    )
    async def model_ready(model: str) -> Response:
        return await _model_ready(gw.model(model))

    @app.get(
        "/v2/models/{model}/versions/{version}/ready",
        response_model=doc.ModelReady,
        tags=["models"],
        dependencies=secured,
        responses=ready_responses,
    )
    async def model_version_ready(model: str, version: str) -> Response:
        return await _model_ready(gw.model(model, version))

    # -- inference ------------------------------------------------------------------------
    async def _infer(spec: ModelSpec, request: Request) -> Response:
        jobs = gw.service()
        body = await read_body(request, settings.gateway.max_body_bytes)
        req = parse_infer_request(body, request.headers.get("inference-header-content-length"))
        names, binary = binary_output_names(req, spec.output_names)
        priority = priority_class(req.parameters.get("priority"))
        timeout_s = timeout_seconds(req.parameters.get("timeout"))
        prefer = parse_prefer(request.headers.getlist("prefer"))
        key = request.headers.get("idempotency-key")
        if key is not None:
            task_id: str | None = check_request_id(key, "Idempotency-Key")
        elif req.id is not None:
            task_id = check_request_id(req.id)
        else:
            task_id = None
        job, _created = await jobs.submit(spec, req.inputs, priority, timeout_s, task_id, len(body))
        if job.model != spec.name:
            raise IdConflict(f"id {job.id!r} already names a job of model {job.model!r}")
        snap = Snapshot(job, None)
        if prefer.respond_async:
            return accepted(job_view(snap, spec), True)
        left_s = None
        if job.deadline_ms is not None:
            left_s = max(0.0, (job.deadline_ms - time.time() * 1000.0) / 1000.0)
        wait_s = wait_budget(
            prefer, left_s, settings.gateway.default_wait_s, settings.gateway.max_wait_s
        )
        if prefer.wait_s is None:  # a result stored right at the deadline still makes it
            wait_s += WAIT_GRACE_S
        meta = await jobs.wait(job, wait_s)
        if meta is None:
            return accepted(job_view(snap, spec), False)
        if meta.get("status") != "SUCCESS":
            view = job_view(Snapshot(job, meta), spec)
            err = view["error"]
            return error_response(err["code"], err["error"], retry_s, id=job.id)
        result = await jobs.resolve(meta.get("result") or {})
        return infer_response(spec, job, req.id, result, names, binary)

    infer_doc: dict[str, Any] = {
        "tags": ["inference"],
        "dependencies": secured,
        "responses": doc.INFER_RESPONSES,
        "openapi_extra": doc.INFER_BODY,
    }

    @app.post("/v2/models/{model}/infer", **infer_doc)
    async def infer(model: str, request: Request) -> Response:
        return await _infer(gw.model(model), request)

    @app.post("/v2/models/{model}/versions/{version}/infer", **infer_doc)
    async def infer_version(model: str, version: str, request: Request) -> Response:
        return await _infer(gw.model(model, version), request)

    # -- jobs -----------------------------------------------------------------------------
    job_responses = {**doc.AUTH, 404: doc.err("no such job (NOT_FOUND)"), **doc.BROKER}

    async def _snapshot(job_id: str) -> Snapshot:
        check_request_id(job_id, "the job id")
        snap = await gw.service().snapshot(job_id)
        if snap is None:
            raise NotFound(f"no job {job_id!r} (unknown, or expired)")
        return snap

    async def _view(snap: Snapshot) -> dict[str, Any]:
        spec = gw.models.get(snap.job.model)
        result = None
        if snap.state == "SUCCESS" and snap.meta is not None:
            result = await gw.service().resolve(snap.meta.get("result") or {})
            await gw.service()._release(snap.job.input_refs)
        return job_view(snap, spec, result)

    @app.get(
        "/v2/jobs/{job_id}",
        response_model=doc.JobView,
        tags=["jobs"],
        dependencies=secured,
        responses=job_responses,
    )
    async def get_job(job_id: str) -> Response:
        return json_response(await _view(await _snapshot(job_id)))

    @app.delete(
        "/v2/jobs/{job_id}",
        response_model=doc.JobView,
        tags=["jobs"],
        dependencies=secured,
        responses={**job_responses, 409: doc.err("final already (ALREADY_FINAL)")},
    )
    async def cancel_job(job_id: str) -> Response:
        """Cancel: 200 with the REVOKED job; 409 ALREADY_FINAL (with its ``state``) when it had
        its final result already (a second DELETE included)."""
        snap = await _snapshot(job_id)
        if not snap.final and await gw.service().cancel(job_id):
            return json_response(await _view(await _snapshot(job_id)))
        snap = await _snapshot(job_id)
        raise AlreadyFinal(f"job {job_id} is final already ({snap.state})", state=snap.state)

    @app.get(
        "/v2/jobs/{job_id}/events",
        tags=["jobs"],
        dependencies=secured,
        responses={
            200: {"description": "text/event-stream: state, progress, final"},
            **job_responses,
        },
    )
    async def job_events(job_id: str, request: Request) -> Response:
        snap = await _snapshot(job_id)
        return StreamingResponse(
            event_stream(gw.service(), snap, request, settings.gateway, _view),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def custom_openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        req = doc.InferenceRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        comps.update(req.pop("$defs", {}))
        comps["InferenceRequest"] = req
        body = {"$ref": "#/components/schemas/InferenceRequest"}
        for path in ("/v2/models/{model}/infer", "/v2/models/{model}/versions/{version}/infer"):
            content = schema["paths"][path]["post"]["requestBody"]["content"]
            content["application/json"]["schema"] = body
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        schema["security"] = [{"bearer": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = custom_openapi  # type: ignore[method-assign]
    return app
