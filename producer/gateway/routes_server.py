"""The gateway's server and model routes: liveness, readiness, server metadata, the OpenAPI
document, and each model's metadata and readiness (OIP v2).

Registered on the app by :func:`producer.gateway.app.create_app`; every route but
``/v2/health/live`` has the bearer check in ``secured``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.responses import Response

from producer.gateway import openapi as doc
from producer.gateway.models import ModelSpec
from producer.gateway.render import error_response, json_response

if TYPE_CHECKING:
    from producer.gateway.state import Gateway

__all__ = ["EXTENSIONS", "SERVER_NAME", "add_model_routes", "add_server_routes"]

SERVER_NAME = "mmfleet"
EXTENSIONS = ["binary_tensor_data", "async_jobs", "server_sent_events", "cancellation"]


def add_server_routes(app: FastAPI, gw: Gateway, secured: list[Any]) -> None:
    """``/v2/health/live``, ``/v2/health/ready``, ``/v2`` and ``/openapi.json``."""
    retry_s = gw.settings.gateway.retry_after_s

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
        models = {
            n: bool(await jobs.live_workers(s.modality, s.live_model)) for n, s in gw.models.items()
        }
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

    # HEAD as GET without the body (uvicorn drops it), for load balancers and uptime probes
    # that check with HEAD; left out of the OpenAPI document, which lists the GETs.
    app.add_api_route("/v2/health/live", live, methods=["HEAD"], include_in_schema=False)
    app.add_api_route(
        "/v2/health/ready", ready, methods=["HEAD"], dependencies=secured, include_in_schema=False
    )

    @app.get("/openapi.json", include_in_schema=False, dependencies=secured)
    async def openapi_schema() -> Response:
        return json_response(app.openapi())


async def model_ready_response(gw: Gateway, spec: ModelSpec) -> Response:
    """200 ``{"name", "ready": true}`` when a worker of the model's modality is live, else
    503 NO_READY_WORKER."""
    nodes = await gw.service().live_workers(spec.modality, spec.live_model)
    if nodes:
        return json_response({"name": spec.name, "ready": True})
    return error_response(
        "NO_READY_WORKER",
        f"no live {spec.modality} worker",
        gw.settings.gateway.retry_after_s,
        name=spec.name,
        ready=False,
    )


def add_model_routes(app: FastAPI, gw: Gateway, secured: list[Any]) -> None:
    """``/v2/models/{model}[/versions/{version}]`` metadata and ``.../ready``."""
    meta_responses = {**doc.AUTH, 404: doc.err("unknown model (MODEL_NOT_FOUND)")}
    ready_responses = {**meta_responses, 503: doc.err("no live worker (NO_READY_WORKER)")}
    meta: dict[str, Any] = {
        "response_model": doc.ModelMetadata,
        "tags": ["models"],
        "dependencies": secured,
        "responses": meta_responses,
    }
    readiness: dict[str, Any] = {**meta, "response_model": doc.ModelReady}
    readiness["responses"] = ready_responses

    @app.get("/v2/models/{model}", **meta)
    async def model_metadata(model: str) -> Response:
        return json_response(gw.model(model).metadata())

    @app.get("/v2/models/{model}/versions/{version}", **meta)
    async def model_version_metadata(model: str, version: str) -> Response:
        return json_response(gw.model(model, version).metadata())

    @app.get("/v2/models/{model}/ready", **readiness)
    async def model_ready(model: str) -> Response:
        return await model_ready_response(gw, gw.model(model))

    @app.get("/v2/models/{model}/versions/{version}/ready", **readiness)
    async def model_version_ready(model: str, version: str) -> Response:
        return await model_ready_response(gw, gw.model(model, version))
