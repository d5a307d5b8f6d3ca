"""The one place the fleet builds a direct Redis client (outside kombu and Celery).

Without sentinels (``[redis] sentinels`` empty) a client is ``redis.Redis.from_url`` on the
role's ``redis://`` URL, as before. With them, it is a client of the primary that
``redis.sentinel.Sentinel`` names for ``[redis] master_name``: its connections ask the
sentinels for the primary's address whenever they (re)connect, and one that meets a
demoted primary (``READONLY``) drops its connections, so a client follows a failover by
itself once the sentinels have promoted the replica.

:class:`Waiter` is the ``WAIT`` policy shared by the producer's publish and the worker's
final-result writes (see ``docs/scale-out.md``, "Redis high availability").
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

from shared.settings import Settings

log = logging.getLogger("fleet.redis")


def sentinel_kwargs(settings: Settings, **kw: Any) -> dict[str, Any]:
    """Connection options for the sentinels themselves: their password and the caller's
    socket timeouts (``socket_timeout``, ``socket_connect_timeout``)."""
    out: dict[str, Any] = {"password": settings.sentinel_password()}
    for k in ("socket_timeout", "socket_connect_timeout"):
        if k in kw:
            out[k] = kw[k]
    return out


def redis_client(settings: Settings, role: str = "admin", **kw: Any) -> redis.Redis:
    """A client of the fleet's Redis (its primary, with sentinels) as ACL user ``role``.

    ``kw``: ``redis.Redis`` options (``socket_timeout``, ``decode_responses``...).

    Raises:
        FileNotFoundError: no password for the role or the sentinels (``fleet up`` first).
    """
    if not settings.ha:
        return redis.Redis.from_url(settings.redis_url(role), **kw)
    user, password = settings.redis_credentials(role)
    return sentinel_master(settings, user, password, **kw)


def sentinel_master(settings: Settings, user: str | None, password: str, **kw: Any) -> redis.Redis:
    """A client of the primary the sentinels name for ``[redis] master_name``, as
    ``user``/``password``; ``kw`` as :func:`redis_client`."""
    from redis.sentinel import Sentinel

    sentinel = Sentinel(
        settings.sentinel_addresses(),
        sentinel_kwargs=sentinel_kwargs(settings, **kw),
        **kw,
    )
    return sentinel.master_for(
        settings.redis.master_name, db=settings.redis.db, username=user, password=password
    )


def async_redis_client(settings: Settings, role: str, max_connections: int = 64) -> Any:
    """A ``redis.asyncio.Redis`` of the primary as ``role``: without sentinels on a
    blocking pool of ``max_connections`` (a burst waits for a connection instead of failing
    with "Too many connections"); with them, through ``redis.asyncio.sentinel``."""
    import redis.asyncio as aioredis

    if not settings.ha:
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.redis_url(role),
            max_connections=max_connections,
            timeout=10,
            health_check_interval=30,
        )
        return aioredis.Redis(connection_pool=pool)
    from redis.asyncio.sentinel import Sentinel

    user, password = settings.redis_credentials(role)
    sentinel = Sentinel(
        settings.sentinel_addresses(),
        sentinel_kwargs=sentinel_kwargs(settings, socket_timeout=5.0),
        socket_timeout=30.0,
    )
    return sentinel.master_for(
        settings.redis.master_name,
        db=settings.redis.db,
        username=user,
        password=password,
        max_connections=max_connections,
        health_check_interval=30,
    )


class Waiter:
    """When a write must wait for replicas (``WAIT numreplicas timeout``) and what to do
    when none answers.

    ``WAIT`` blocks until ``replicas`` replicas have acknowledged every write this
    connection made so far (replication is one ordered stream), or ``timeout_ms``. When it
    times out short (no replica attached: after a primary's SIGKILL the promoted replica
    has none until the old primary returns) the write stands unreplicated, as it would
    without ``WAIT``, and the waiter stops waiting for ``backoff_s`` so that each write
    does not pay the whole timeout; it tries again after that.

    Thread safety: any thread may call :meth:`due` and :meth:`record`.
    """

    def __init__(self, replicas: int, timeout_ms: int, backoff_s: float = 2.0) -> None:
        self.replicas = replicas
        self.timeout_ms = timeout_ms
        self.backoff_s = backoff_s
        self.short = 0  # WAITs that returned fewer replicas than asked
        self._skip_until = 0.0  # monotonic
        self._lock = threading.Lock()

    @classmethod
    def of(cls, settings: Settings) -> Waiter | None:
        """The settings' waiter: ``None`` without sentinels or with ``wait_replicas`` 0."""
        r = settings.redis
        return cls(r.wait_replicas, r.wait_timeout_ms) if settings.ha and r.wait_replicas else None

    def due(self, now: float | None = None) -> bool:
        """Whether the next write should be followed by ``WAIT``."""
        return (time.monotonic() if now is None else now) >= self._skip_until

    def args(self) -> tuple[str, int, int]:
        """The command: ``("WAIT", replicas, timeout_ms)``."""
        return ("WAIT", self.replicas, self.timeout_ms)

    def record(self, acked: Any, now: float | None = None) -> bool:
        """Take ``WAIT``'s reply (replicas that acknowledged); return whether it sufficed.
        A short reply pauses waiting for ``backoff_s``."""
        try:
            ok = int(acked) >= self.replicas
        except (TypeError, ValueError):
            ok = False
        if not ok:
            with self._lock:
                self.short += 1
                self._skip_until = (time.monotonic() if now is None else now) + self.backoff_s
            log.warning(
                "WAIT: %s of %d replicas acknowledged within %d ms; writes go on unreplicated "
                "for %.0f s",
                acked,
                self.replicas,
                self.timeout_ms,
                self.backoff_s,
            )
        return ok
