"""The gateway's state: settings, token, the models it serves and the job service.

Built by ``producer.gateway.app.create_app`` and handed to every route module.
"""

from __future__ import annotations

import asyncio

from producer.gateway.errors import ModelNotFound
from producer.gateway.jobs import JobService
from producer.gateway.models import VERSION, ModelSpec, model_specs
from shared.settings import Settings

__all__ = ["Gateway"]


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
