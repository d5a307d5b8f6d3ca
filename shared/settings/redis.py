"""``[redis]`` settings and the Redis credentials and URLs derived from them.

:class:`RedisSettings` is the ``[redis]`` table; :class:`RedisAccess` gives
:class:`shared.settings.Settings` (which mixes it in) the per-role credentials (``shared.acl``),
the ``redis://`` or ``sentinel://`` URL and the Sentinel addresses and password;
:func:`url_fields` reads such a URL back into ``[redis]`` keys (``FLEET_REDIS_URL``,
``FleetClient.from_url``). Secrets come from ``FLEET_REDIS__*`` variables, from such a URL or
from files under the run directory that ``fleet up`` creates; never from the TOML file.
Import these names from ``shared.settings``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["URL_QUERY_KEYS", "RedisAccess", "RedisSettings", "url_fields"]


class RedisSettings(BaseModel):
    """``[redis]``: where the fleet's Redis is, its leases, results and Sentinel (HA)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = 6390
    db: int = 0
    # Explicit credentials (an external Redis, compose, Kubernetes): every role of this
    # process connects with them. Without a password, each process connects as the ACL user
    # of its role (shared.acl) with the password `fleet up` generated for it under run_dir.
    user: str | None = None
    password: str | None = None
    # Batching workers hold a lease on every message they hold (workers.consumer.lease): a dead
    # worker's messages are back in their queue within lease_s, a live worker's never leave.
    lease_s: float = Field(default=10.0, ge=1.0, le=3600.0)
    # Batching workers wait for messages on push notifications (the server needs
    # notify-keyspace-events Kl; `fleet up` sets it) and take each with an atomic script;
    # false, or a server without them: kombu's BRPOP, which loses the message in flight
    # when a worker is killed.
    fetch_notify: bool = True
    # The last resort for consumers without leases (baseline workers, plain Celery).
    visibility_timeout_s: int = 3600
    restore_scan_interval_s: float = 10.0  # how often a worker returns expired unacked messages
    # Deadlines, lease scores and heartbeats are on Redis' clock (TIME; shared.clock): a
    # host's own clock cannot fail or hide work. A worker whose clock is further than this
    # off Redis' logs a warning (and always exports fleet_worker_clock_skew_seconds); 0: no
    # warning.
    clock_skew_warn_s: float = Field(default=1.0, ge=0.0)
    result_expires_s: int = 86400
    # High availability (Redis Sentinel, shared.redis_client): with sentinels ("host:port"
    # each), every process asks them for the primary of ``master_name`` and follows it
    # through a failover; host and port above are then only where `fleet up --ha` starts
    # the primary (the replica on port + 1). The sentinels' own password: sentinel_password,
    # else <run_dir>/redis-sentinel.password.
    sentinels: list[str] = Field(default_factory=list)
    master_name: str = "mmfleet"
    sentinel_password: str | None = None
    # With sentinels: a publish, and a batch's final results before their ack, wait until
    # this many replicas have them (WAIT), at most wait_timeout_ms; 0 turns WAIT off.
    # Without a replica attached (the old primary not back yet) writes go on unreplicated.
    wait_replicas: int = Field(default=1, ge=0)
    wait_timeout_ms: int = Field(default=250, ge=1)
    # The sentinels `fleet up --ha` starts: a primary silent this long is down (then a
    # quorum of 2 fails over); a failover not done within the timeout is tried again.
    sentinel_down_after_ms: int = Field(default=2000, ge=100)
    sentinel_failover_timeout_ms: int = Field(default=10000, ge=1000)

    @field_validator("sentinels")
    @classmethod
    def _host_ports(cls, v: list[str]) -> list[str]:
        for entry in v:
            host, _, port = entry.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"sentinel {entry!r} is not host:port")
        return v

    @property
    def lease_renew_s(self) -> float:
        """How often a worker renews its leases (seconds)."""
        return self.lease_s / 5.0

    @property
    def lease_scan_s(self) -> float:
        """How often a batching worker returns lapsed leases' messages (seconds)."""
        return min(self.restore_scan_interval_s, self.lease_s / 10.0)

    @property
    def lease_expiry_s(self) -> float:
        """Age of a lease's last renewal after which its message is returned (seconds):
        the lease less one renewal period and one scan, so a dead worker's messages are back
        within ``lease_s`` of its death."""
        return self.lease_s - self.lease_renew_s - self.lease_scan_s


class RedisAccess:
    """Redis credentials and URLs of a :class:`shared.settings.Settings` (mixed into it): reads
    its ``redis`` section and its run directory, holds no state of its own."""

    if TYPE_CHECKING:
        redis: RedisSettings

        @property
        def run_dir(self) -> Path: ...

    def redis_password(self) -> str:
        """The admin password: ``FLEET_REDIS__PASSWORD`` or ``<run_dir>/redis.password``.

        Raises:
            FileNotFoundError: neither is set (run ``fleet up`` first, or set the variable).
        """
        if self.redis.password:
            return self.redis.password
        return (self.run_dir / "redis.password").read_text().strip()

    def redis_password_file(self, role: str) -> Path:
        """Where ``fleet up`` keeps the password of ``role`` (``admin``: ``redis.password``)."""
        return self.run_dir / ("redis.password" if role == "admin" else f"redis-{role}.password")

    def redis_credentials(self, role: str) -> tuple[str | None, str]:
        """``(user, password)`` for a process playing ``role`` (``producer``, ``worker``,
        ``operator`` or ``admin``; see ``shared.acl``). ``FLEET_REDIS__PASSWORD`` (and
        ``FLEET_REDIS__USER``) win for every role; else the role's file under ``run_dir``.

        Raises:
            FileNotFoundError: no password set and no file for the role (run ``fleet up``).
        """
        if self.redis.password:
            return self.redis.user, self.redis.password
        password = self.redis_password_file(role).read_text().strip()
        return (None if role == "admin" else role), password

    @property
    def ha(self) -> bool:
        """Whether the fleet finds its Redis through Sentinel (``[redis] sentinels``)."""
        return bool(self.redis.sentinels)

    def sentinel_addresses(self) -> list[tuple[str, int]]:
        """``[(host, port), ...]`` of the configured sentinels."""
        out = []
        for entry in self.redis.sentinels:
            host, _, port = entry.rpartition(":")
            out.append((host, int(port)))
        return out

    def sentinel_password(self) -> str:
        """The sentinels' password: ``FLEET_REDIS__SENTINEL_PASSWORD`` or
        ``<run_dir>/redis-sentinel.password`` (``fleet up --ha`` creates it).

        Raises:
            FileNotFoundError: neither is set.
        """
        if self.redis.sentinel_password:
            return self.redis.sentinel_password
        return (self.run_dir / "redis-sentinel.password").read_text().strip()

    def redis_url(self, role: str = "admin") -> str:
        """A ``redis://`` URL with the credentials of ``role`` (see :meth:`redis_credentials`);
        with sentinels, kombu's and Celery's ``sentinel://`` form: one URL per sentinel joined
        by ``;``, each with the role's credentials for the primary (the master name and the
        sentinels' password travel in transport options: ``shared.celery_app``).

        Raises:
            FileNotFoundError: as :meth:`redis_credentials`.
        """
        user, password = self.redis_credentials(role)
        auth = f"{quote(user or '', safe='')}:{quote(password, safe='')}"
        if self.ha:
            return ";".join(
                f"sentinel://{auth}@{h}:{p}/{self.redis.db}" for h, p in self.sentinel_addresses()
            )
        return f"redis://{auth}@{self.redis.host}:{self.redis.port}/{self.redis.db}"


URL_QUERY_KEYS = ("master_name", "sentinel_password")


"""The ``[redis]`` keys a ``sentinel://`` URL may carry in its query (what kombu and Celery take
as transport options beside the URL)."""


def url_fields(url: str) -> dict[str, Any]:
    """The ``[redis]`` keys ``url`` names: what :meth:`RedisAccess.redis_url` writes, read back.

    - ``redis://[user][:password]@host[:port][/db]``: ``host``, ``port`` (6379 when absent,
      as every Redis client reads such a URL), ``db`` (0), ``user``, ``password``, and no
      ``sentinels``.
    - ``sentinel://[user][:password]@host[:port][/db]``, one per sentinel joined by ``;``
      (kombu's and Celery's form; port 26379 when absent): ``sentinels``, ``db``, ``user``
      and ``password`` (the primary's credentials: the parts that name them agree), and
      from a query (``?master_name=mmfleet&sentinel_password=...``, on any part)
      ``master_name`` and ``sentinel_password``.

    A user or password the URL does not name is left out (the settings' own stand: without a
    password, the role's file under the run dir). Percent-escapes are decoded (``%40`` in a
    password is ``@``).

    Raises:
        ValueError: another scheme, no host, a port or db that is not a number, parts of a
            sentinel URL that disagree on the credentials or db, an unknown query key.
    """
    parts = [p.strip() for p in url.split(";") if p.strip()]
    if not parts:
        raise ValueError("a Redis URL is empty")
    split = [urlsplit(p) for p in parts]
    schemes = {s.scheme for s in split}
    if schemes == {"redis"} and len(split) == 1:
        found = _address(split[0], 6379)
        return _present({**found, "db": found["db"] or 0, "sentinels": []})
    if schemes != {"sentinel"}:
        raise ValueError(
            f"{_redacted(url)}: expected redis://[user:password@]host[:port][/db], or "
            f"sentinel://[user:password@]host[:port][/db] parts joined by ';'"
        )
    addresses = [_address(s, 26379) for s in split]
    out: dict[str, Any] = {"sentinels": [f"{a['host']}:{a['port']}" for a in addresses]}
    for key in ("db", "user", "password"):  # a part that names none takes the others'
        given = {a[key] for a in addresses if a[key] is not None}
        if len(given) > 1:
            raise ValueError(f"{_redacted(url)}: the sentinel URLs name different {key}s")
        out[key] = given.pop() if given else (0 if key == "db" else None)
    out = _present(out)
    for s in split:
        for key, value in parse_qsl(s.query, keep_blank_values=True, strict_parsing=False):
            if key not in URL_QUERY_KEYS:
                raise ValueError(
                    f"{_redacted(url)}: unknown query key {key!r} (known: "
                    f"{', '.join(URL_QUERY_KEYS)})"
                )
            out[key] = value
    return out


def _present(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` without a user or password the URL does not name (the settings' stand)."""
    return {k: v for k, v in fields.items() if v is not None or k not in ("user", "password")}


def _address(part: Any, default_port: int) -> dict[str, Any]:
    """Host, port, db and credentials of one ``urlsplit`` result.

    Raises:
        ValueError: no host, or a port or db that is not a number.
    """
    try:
        port = part.port
    except ValueError:
        port = -1
    db_text = part.path.strip("/")
    if not part.hostname or port == -1 or not (db_text.isdigit() or not db_text):
        raise ValueError(
            f"{_redacted(part.geturl())}: a Redis URL needs a host, a numeric port and a "
            f"numeric db (redis://host:6390/0)"
        )
    if part.scheme == "redis" and part.query:
        raise ValueError(f"{_redacted(part.geturl())}: a redis:// URL takes no query")
    return {
        "host": part.hostname,
        "port": default_port if port is None else port,
        "db": int(db_text) if db_text else None,
        "user": unquote(part.username) if part.username else None,
        "password": unquote(part.password) if part.password else None,
    }


def _redacted(url: str) -> str:
    """``url`` without its passwords (for error messages): the URL's own as ``***``, its
    query (a sentinel password, maybe misspelled) as ``?...``."""
    return ";".join(_redact_one(p) for p in url.split(";"))


def _redact_one(url: str) -> str:
    part = urlsplit(url)
    if part.query:
        part = part._replace(query="...")
    if part.password:
        part = part._replace(netloc=part.netloc.replace(f":{part.password}@", ":***@", 1))
    return part.geturl()
