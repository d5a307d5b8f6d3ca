"""``fleet gateway``: serve the gateway app with uvicorn (httptools + uvloop when installed).

Several gateway processes may serve one fleet side by side (``--workers N``, or separate
commands on other ports): they keep no state but Redis.
"""

from __future__ import annotations

import importlib.util
import logging

from shared.settings import Settings

log = logging.getLogger("fleet.gateway")


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def factory() -> object:
    """The app for uvicorn's ``--factory`` (worker processes build their own)."""
    from producer.gateway.app import create_app
    from shared.settings import load_settings

    return create_app(load_settings())


def serve(settings: Settings, workers: int = 1, log_level: str = "info") -> None:
    """Run the gateway in the foreground until SIGTERM/SIGINT.

    Binds ``[gateway] host:port`` (loopback by default). The token file is created before
    the workers start, so every process reads the same token.

    Raises:
        OSError: the port is taken.
    """
    import uvicorn

    settings.gateway_token()  # create <run_dir>/gateway.token (0600) once, before forking
    g = settings.gateway
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    uvicorn.run(
        "producer.gateway.server:factory",
        factory=True,
        host=g.host,
        port=g.port,
        workers=workers,
        loop="uvloop" if _has("uvloop") else "asyncio",
        http="httptools" if _has("httptools") else "h11",
        log_level=log_level,
        access_log=False,  # one line per request costs more than the request's own path
        # keep-alive clients (tritonclient's pool, load generators) reuse idle connections for
        # longer than uvicorn's 5 s default; closing them under a client races its next request
        timeout_keep_alive=75,
        lifespan="on",
    )
