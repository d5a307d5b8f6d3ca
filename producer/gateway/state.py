"""The gateway's state: settings, token, the models it serves, its producer API (one
``producer.client.AsyncFleetClient``) and the job service on it.

Built by ``producer.gateway.app.create_app`` and handed to every route module; the client
and the service are made at start-up, on the event loop that serves the app.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from producer.gateway.jobs import JobService
from producer.gateway.models import ModelSpec, model_specs, pick_spec
from shared.settings import Settings

if TYPE_CHECKING:
    from producer.client import AsyncFleetClient

__all__ = ["CONNECTIONS", "Gateway"]

CONNECTIONS = 64  # the gateway's Redis pool: concurrent requests' commits, reads and waits


class Gateway:
    """The app's state: settings, token, models, the client and the job service (the last two
    built at start-up)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.token = settings.gateway_token()
        # tenant -> its own bearer token ([tenants.<name>] gateway_token; producer.gateway.auth)
        self.tenant_tokens = {
            name: t.gateway_token
            for name, t in settings.tenants.items()
            if t.gateway_token is not None
        }
        self.models: dict[str, ModelSpec] = model_specs(settings)
        self.client: AsyncFleetClient | None = None
        self.jobs: JobService | None = None

    async def start(self) -> None:
        """Build the producer API, one ``AsyncFleetClient`` as the producer user, and the
        job service on it. The client's ``redis.asyncio`` pool (:data:`CONNECTIONS`, a
        burst waits for one) carries every Redis call of the gateway: job commits and
        reads, liveness and depths, cancels, and the one pubsub connection results arrive
        on."""
        from producer.client import AsyncFleetClient
        from shared.redis_client import async_redis_client

        redis = async_redis_client(self.settings, "producer", max_connections=CONNECTIONS)
        self.client = AsyncFleetClient(self.settings, role="producer", redis=redis)
        self.jobs = JobService(self.client, self.models)
        await self.jobs.start()

    async def stop(self) -> None:
        if self.jobs is not None:
            await self.jobs.stop()
        if self.client is not None:
            try:
                await self.client.aclose()  # its subscriptions, /dev/shm store, Celery app
            finally:
                await self.client.redis.aclose(close_connection_pool=True)

    def service(self) -> JobService:
        assert self.jobs is not None, "the gateway has not started"
        return self.jobs

    def model(self, name: str, version: str | None = None) -> ModelSpec:
        """The model ``name`` at ``version`` (``None``: its latest, Triton's default policy).

        Raises:
            ModelNotFound: no such model or version (404).
        """
        return pick_spec(self.models, name, version)
