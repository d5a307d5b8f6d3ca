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
from collections.abc import Sequence
from typing import Any

import redis

from shared.settings import Settings

__all__ = [
    "SETTLED_PRIMARY_FLAGS_BAD",
    "AuthNotRetried",
    "Connection",
    "CredentialsRefused",
    "ReplicationUncertain",
    "SentTransaction",
    "Waiter",
    "async_redis_client",
    "execute_waiting",
    "node_client",
    "pack",
    "redis_client",
    "send_transaction",
    "sentinel_kwargs",
    "sentinel_master",
    "sentinel_node",
    "still_primary",
]


# Where a producer logs in (shared.kombu_redis, shared.ha): here, with the clients, as the
# login runs on the request path (a result subscription reconnects).
class CredentialsRefused(redis.RedisError):
    """Redis refused the credentials a connection logged in with (``WRONGPASS``,
    ``NOAUTH``): redis-py's ``AuthenticationError`` (its ``__cause__``) as an error that is
    not a ``ConnectionError``, so that neither redis-py's retry nor kombu's retries it."""


class AuthNotRetried:
    """A redis-py connection mixin: a refused login raises :class:`CredentialsRefused`."""

    def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().connect_check_health(*args, **kwargs)  # type: ignore[misc]
        except redis.AuthenticationError as exc:
            raise CredentialsRefused(str(exc)) from exc


class Connection(AuthNotRetried, redis.Connection):
    """redis-py's connection, a refused login not retried."""


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


def node_client(
    settings: Settings, host: str, port: int, role: str = "admin", **kw: Any
) -> redis.Redis:
    """A client of one data node (``host:port``) as ``role``, whatever its role in
    replication: for the stack's own checks and the HA drills, never for fleet traffic."""
    user, password = settings.redis_credentials(role)
    return redis.Redis(
        host=host, port=port, db=settings.redis.db, username=user, password=password, **kw
    )


def sentinel_node(settings: Settings, host: str, port: int, **kw: Any) -> redis.Redis:
    """A client of one sentinel (its password), for the stack's checks and drills."""
    kw.setdefault("socket_timeout", 2.0)
    kw.setdefault("socket_connect_timeout", 1.0)
    return redis.Redis(host=host, port=port, password=settings.sentinel_password(), **kw)


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


class ReplicationUncertain(redis.ConnectionError):
    """A write that ``WAIT`` could not confirm on a replica went to a node the sentinels no
    longer name as primary (a failover under way): it may be discarded when that node is
    demoted. Nothing is confirmed; the caller retries it (a duplicate is harmless: final
    results are first-wins, ``workers.batching.completion``)."""


class Waiter:
    """When a write waits for replicas (``WAIT numreplicas timeout``) and what a short
    answer means.

    ``WAIT`` blocks until ``replicas`` replicas have acknowledged every write its
    connection made so far (replication is one ordered stream), or ``timeout_ms``. A short
    answer has two causes, told apart by asking the sentinels which node is primary:

    - the node written to is no longer the primary (``SENTINEL FAILOVER``: the replica was
      promoted, the old primary not demoted yet): the write may be lost, so
      :func:`execute_waiting` raises :class:`ReplicationUncertain` and the caller retries;
    - it is the primary but has no replica (after a primary's SIGKILL, until the old one
      returns as a replica): the write stands, as it would without ``WAIT``, and the waiter
      stops waiting for ``backoff_s`` so that each write does not pay the whole timeout;
      meanwhile each write is checked with the sentinels after it is made instead.

    Thread safety: any thread may call every method.
    """

    def __init__(self, replicas: int, timeout_ms: int, backoff_s: float = 2.0) -> None:
        self.replicas = replicas
        self.timeout_ms = timeout_ms
        self.backoff_s = backoff_s
        self.short = 0  # WAITs that returned fewer replicas than asked
        self.uncertain = 0  # of those, on a node that was no longer the primary
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

    def enough(self, acked: Any) -> bool:
        """Whether ``WAIT``'s reply (replicas that acknowledged) is enough."""
        try:
            return int(acked) >= self.replicas
        except (TypeError, ValueError):
            return False

    def short_answer(self, primary: bool, now: float | None = None) -> None:
        """Record a short ``WAIT``; ``primary``: the node is still the primary (then pause
        waiting for ``backoff_s``)."""
        with self._lock:
            self.short += 1
            if primary:
                self._skip_until = (time.monotonic() if now is None else now) + self.backoff_s
            else:
                self.uncertain += 1
        if primary:
            log.warning(
                "WAIT: no replica acknowledged within %d ms and the primary has none attached: "
                "writes go on unreplicated for %.0f s",
                self.timeout_ms,
                self.backoff_s,
            )


SETTLED_PRIMARY_FLAGS_BAD = ("failover_in_progress", "s_down", "o_down")


def still_primary(client: redis.Redis, host: str, port: int) -> bool:
    """Whether every answering sentinel names ``host:port`` as the primary, with no
    failover under way (always true for a client without Sentinel); false when none
    answers.

    The sentinel leading a failover keeps naming the old primary until the failover ends,
    though the replica may already be promoted (``failover_in_progress``), and the other
    sentinels learn of the switch a moment later (their hello messages): any sentinel that
    disagrees, or flags the primary ``failover_in_progress``, ``s_down`` or ``o_down``,
    makes the answer "no"."""
    pool = client.connection_pool
    manager = getattr(pool, "sentinel_manager", None)
    if manager is None:
        return True
    answered = 0
    for sentinel in list(manager.sentinels):
        try:
            state = sentinel.sentinel_master(pool.service_name)
        except redis.RedisError:
            continue
        answered += 1
        flags = str(state.get("flags", ""))
        if any(f in flags for f in SETTLED_PRIMARY_FLAGS_BAD):
            return False
        if (str(state["ip"]), int(state["port"])) != (str(host), int(port)):
            return False
    return answered > 0


def execute_waiting(client: redis.Redis, pipe: Any, waiter: Waiter | None) -> list[Any]:
    """Execute ``pipe`` (a pipeline of ``client``) so that its writes survive a failover:
    followed by ``WAIT`` on the same connection; while the waiter backs off (the primary
    has no replica), checked afterwards with the sentinels instead. Returns the pipeline's
    replies (``WAIT``'s not among them).

    Raises:
        ReplicationUncertain: the writes went to a node that is no longer (or not surely)
            the primary, unconfirmed by a replica: they may be lost; retry them.
        redis.RedisError: as ``pipe.execute()``.
    """
    if waiter is None:
        return list(pipe.execute())
    conn = client.connection_pool.get_connection()
    pipe.connection = conn  # execute() runs on it; its reset() gives it back to the pool
    waited = waiter.due()
    if waited:
        pipe.execute_command(*waiter.args())
    replies = list(pipe.execute())
    host, port = conn.host, conn.port  # after execute: a retry may have reconnected it
    _confirm(client, waiter, replies.pop() if waited else None, host, port)
    return replies


def send_transaction(
    client: redis.Redis,
    commands: Sequence[tuple[Any, ...]],
    waiter: Waiter | None,
    conn: Any = None,
    atomic: bool = True,
) -> SentTransaction:
    """Send ``commands`` (each ``(name, *args)``) as one ``MULTI``/``EXEC`` transaction on one
    connection of ``client``, in one write: Redis applies all of them or none. With a
    waiter, ``WAIT`` follows ``EXEC`` on that connection (inside ``MULTI`` it could not
    block) and a short answer is handled as :func:`execute_waiting` does. Returns before the
    replies: read them with :meth:`SentTransaction.replies` (or give the connection up with
    :meth:`SentTransaction.abandon`). ``conn``: a connection of ``client``'s pool the
    caller holds (and gives back), sent on and read from in order; else one is taken from
    the pool until the replies are read. ``atomic=False``: the commands go as a plain
    pipeline (no ``MULTI``/``EXEC``: reads that need no common snapshot).

    Raises:
        redis.ConnectionError, redis.TimeoutError: the send failed (the connection is
            dropped); the transaction may have reached Redis.
    """
    waited = waiter is not None and waiter.due()
    sent: list[tuple[Any, ...]] = [("MULTI",), *commands, ("EXEC",)] if atomic else [*commands]
    if waited:
        sent.append(waiter.args())  # type: ignore[union-attr]
    pool = client.connection_pool
    own = conn is None
    if own:
        conn = pool.get_connection()
    try:
        conn.send_packed_command([pack(sent)])
    except BaseException:
        conn.disconnect()
        if own:
            pool.release(conn)
        raise
    return SentTransaction(
        client, conn, len(commands), waiter if waited else None, waiter, own, atomic
    )


class SentTransaction:
    """A transaction :func:`send_transaction` sent, its replies unread."""

    def __init__(
        self,
        client: redis.Redis,
        conn: Any,
        n_commands: int,
        waited: Waiter | None,
        waiter: Waiter | None,
        release: bool = True,
        atomic: bool = True,
    ) -> None:
        self._client, self._conn, self._n = client, conn, n_commands
        self._waited, self._waiter = waited, waiter
        self._release = release  # the connection goes back to the pool after the replies
        self._atomic = atomic

    def replies(self) -> list[Any]:
        """``EXEC``'s replies (or the pipeline's), one per command.

        Raises:
            ReplicationUncertain: as :func:`execute_waiting` (the transaction was applied on
                a node that may be demoted; retry it).
            redis.ConnectionError, redis.TimeoutError: the connection broke (it is dropped).
                The transaction was applied or not: an ``EXEC`` whose reply was lost may
                have run.
            redis.ResponseError: Redis refused a command (``EXECABORT``: nothing was
                applied) or one failed inside the transaction (the others were applied).
            redis.WatchError: a key the connection ``WATCH``ed changed (nothing applied).
        """
        conn, pool = self._conn, self._client.connection_pool
        n = self._n
        framing = 2 if self._atomic else 0  # MULTI, EXEC
        try:
            replies = []
            for _ in range(n + framing + (self._waited is not None)):  # [MULTI,] n[, EXEC][, WAIT]
                try:  # every reply is read, errors included, so the connection stays usable
                    replies.append(conn.read_response())
                except redis.ResponseError as exc:
                    replies.append(exc)
            host, port = conn.host, conn.port
        except BaseException:
            conn.disconnect()  # replies may be left unread on it
            raise
        finally:
            if self._release:
                pool.release(conn)
        if self._atomic:
            exec_reply = replies[n + 1]
            failed = [r for r in replies[: n + 1] if isinstance(r, Exception)]
            if isinstance(exec_reply, Exception) or failed:
                raise failed[0] if failed else exec_reply
            if exec_reply is None:  # a key WATCHed before MULTI changed: nothing was applied
                raise redis.WatchError("a watched key changed; the transaction was not applied")
            result = list(exec_reply)
        else:
            result = replies[:n]
        failed = [r for r in result if isinstance(r, Exception)]
        if failed:
            raise failed[0]
        if self._waiter is not None:
            _confirm(self._client, self._waiter, replies[-1] if self._waited else None, host, port)
        return result

    def abandon(self) -> None:
        """Give the connection up unread (it is dropped: its replies would be left on it)."""
        self._conn.disconnect()
        if self._release:
            self._client.connection_pool.release(self._conn)


def pack(commands: Sequence[tuple[Any, ...]]) -> bytes:
    """The RESP bytes of ``commands`` (arguments: ``bytes``, ``str`` as UTF-8, numbers), in
    one piece: what ``Connection.pack_commands`` sends, without its per-command Python
    overhead (``producer.client.fleet`` packs thousands a second)."""
    out: list[bytes] = []
    for command in commands:
        out.append(b"*%d\r\n" % len(command))
        for arg in command:
            if type(arg) is not bytes:
                if isinstance(arg, str):
                    arg = arg.encode()
                elif isinstance(arg, int):
                    arg = b"%d" % arg
                elif isinstance(arg, float):
                    arg = repr(arg).encode()
            out += (b"$%d\r\n" % len(arg), arg, b"\r\n")
    return b"".join(out)


def _confirm(client: redis.Redis, waiter: Waiter, acked: Any, host: str, port: int) -> None:
    """After writes on ``host:port``: ``acked`` is ``WAIT``'s reply (``None``: no ``WAIT``
    was sent, the waiter backing off). Returns when the writes stand.

    Raises:
        ReplicationUncertain: see :func:`execute_waiting`.
    """
    if acked is not None:
        if waiter.enough(acked):
            return
        primary = still_primary(client, host, port)
        waiter.short_answer(primary)
    else:
        primary = still_primary(client, host, port)
    if not primary:
        # every connection of the pool asks the sentinels again when it reconnects
        client.connection_pool.disconnect()
        raise ReplicationUncertain(
            f"{host}:{port} is not surely the primary and no replica confirmed the write"
        )
