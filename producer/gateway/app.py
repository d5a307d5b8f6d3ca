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
    GET    /docs                                 the API page over it (routes_docs: public shell)

Build with :func:`create_app`; ``fleet gateway`` serves it with uvicorn. The app's state is a
:class:`Gateway` (``producer.gateway.state``): the settings, the models, and from the app's
start-up to its shutdown one ``producer.client.AsyncFleetClient``, the producer API every
route goes through, with the job service (``producer.gateway.jobs``) on it. This module holds
the error handlers and the OpenAPI document; the routes are registered by ``routes_server``
(health, server and model metadata, readiness), ``routes_infer`` (inference) and
``routes_jobs`` (jobs, events, cancel).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from producer.gateway import openapi as doc
from producer.gateway.auth import bearer_tenant
from producer.gateway.render import error_response, fleet_error_response
from producer.gateway.routes_docs import add_docs_routes
from producer.gateway.routes_infer import add_infer_routes, read_body
from producer.gateway.routes_jobs import add_job_routes
from producer.gateway.routes_server import (
    EXTENSIONS,
    SERVER_NAME,
    add_model_routes,
    add_server_routes,
)
from producer.gateway.state import Gateway
from shared.errors import FleetError
from shared.settings import Settings

__all__ = ["EXTENSIONS", "SERVER_NAME", "Gateway", "create_app", "read_body"]

log = logging.getLogger("fleet.gateway")


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

    async def auth(request: Request) -> None:  # async: FastAPI runs a sync one on a thread
        header = request.headers.get("authorization")
        request.state.bound_tenant = bearer_tenant(header, gw.token, gw.tenant_tokens)

    secured = [Depends(auth)]
    add_error_handlers(app, settings.gateway.retry_after_s)
    # Registration order is the OpenAPI document's order.
    add_server_routes(app, gw, secured)
    add_model_routes(app, gw, secured)
    add_infer_routes(app, gw, secured)
    add_job_routes(app, gw, secured)
    add_docs_routes(app)
    install_openapi(app)
    return app


def add_error_handlers(app: FastAPI, retry_s: int) -> None:
    """Every error as the gateway's JSON error body: a ``FleetError`` with its code's status,
    HTTP and validation errors as NOT_FOUND/METHOD_NOT_ALLOWED/INVALID_INPUT, Redis down as
    BROKER_UNAVAILABLE (``Retry-After: retry_s``), anything else FLEET_ERROR (logged)."""

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
            from shared.redis_refusal import broker_unavailable

            return fleet_error_response(broker_unavailable(exc, "Redis"), retry_s)
        log.exception("unexpected error")
        return error_response("FLEET_ERROR", f"internal error ({type(exc).__name__})")


def install_openapi(app: FastAPI) -> None:
    """``app.openapi()``: the routes' schema with the OIP ``InferenceRequest`` as the infer
    routes' JSON body and bearer security (built once, then cached on the app)."""

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
