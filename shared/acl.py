"""Redis ACL users of the fleet: who may run which command on which keys and channels.

``fleet up`` writes one ``user`` line per role into the generated ``redis.conf`` (the run
directory is 0700, the file 0600, and passwords appear only as SHA-256 hashes), and every
process connects as the role it plays (``Settings.redis_credentials``):

========== ===================================================================================
role        may
========== ===================================================================================
producer    enqueue (``LPUSH`` onto the modality queues, kombu's bindings), read results
            (``GET``/``MGET``/``SUBSCRIBE`` on ``celery-task-meta-*``), cancel (one
            ``WATCH``/``MULTI`` transaction: the final marker on ``fleet:final:*`` and the
            REVOKED result, unless a final result stands), read worker liveness
            (``fleet:live:*``) and Redis' clock (``TIME``), publish ``task-sent`` events,
            ``WAIT`` for a replica after a publish (Redis behind Sentinel), ``INFO`` (the
            ready check of ioredis, celery-node's client: server statistics, no key's data;
            an ACL cannot narrow a bare ``INFO`` to sections), a tenant's open requests
            (``fleet:tenant:*``: ``SCARD``, ``SMISMEMBER``, ``SADD``, and ``SREM`` at a
            cancel; ``shared.tenant_quota``).
            Nothing else: no ``EVAL``, ``CONFIG``, ``FLUSHALL``, ``SHUTDOWN``, ``KEYS``, no
            other key or channel.
worker      every key and channel, every command but Redis's ``@dangerous`` ones (``CONFIG``,
            ``FLUSHALL``, ``SHUTDOWN``, ``KEYS``, ``DEBUG``, ``ACL``, ``CLIENT KILL``...):
            workers run the fleet's Lua scripts (fetch, result writes, batch gate, the
            blame lookup, which reads ``fleet:blame:*`` records by the names its index holds).
operator    Flower, ``fleet status``, ``fleet exporter``, the bench's event tap: read
            everything, control broadcasts (ping, inspect, revoke), ``INFO``, scripts
            (kombu's restore mutex is one; the exporter's queue-stats read is another:
            ``LLEN``/``LINDEX``/``HGETALL`` in ``EVALSHA``), event subscriptions; no
            ``@dangerous``.
admin       Redis's ``default`` user (``<run_dir>/redis.password``): everything. For
            ``fleet chaos`` (it injects faults with ``CLIENT KILL`` and ``ACL SETUSER``),
            the tests and the person on call; no fleet process runs as it.
========== ===================================================================================

The rules are written for Redis 6.2 and later (no selectors; ``resetchannels`` explicit,
since 6.2 defaults to all channels). compose.yaml carries the same rules (a unit test keeps
the two equal).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from shared import schema
from shared.settings import MODALITIES
from shared.tenant_quota import OPEN_PREFIX

__all__ = [
    "ADMIN",
    "PRODUCER_COMMANDS",
    "ROLES",
    "client_subcommands",
    "password_hash",
    "producer_channels",
    "producer_keys",
    "rules",
    "server_version",
    "user_lines",
]

ROLES: tuple[str, ...] = ("producer", "worker", "operator")
ADMIN = "admin"  # Redis's ``default`` user

# Commands a producer needs, as sent by kombu (publish, bindings), Celery's Redis result
# backend (results, their pubsub) and producer.client (queue depth, cancel, liveness).
PRODUCER_COMMANDS: tuple[str, ...] = (
    "ping", "hello", "auth", "select", "reset", "multi", "exec", "discard",
    "watch", "unwatch",  # optimistic transactions: cancel, a gateway job's record + message
    "lpush", "llen", "exists", "sadd", "smembers",
    "scard", "smismember",  # a tenant's max_queued, checked before a push (shared.tenant_quota)
    "srem",  # a cancel releases the request from its tenant's open set
    "get", "mget", "set", "setex",
    "publish", "subscribe", "unsubscribe",
    "zrangebyscore",
    "time",  # Redis' clock: submit times, deadlines and liveness are on it (shared.clock)
    "wait",  # with Sentinel: a publish waits for a replica (shared.ha)
    "info",  # ioredis' ready check (celery-node): server statistics, no key's data
)  # fmt: skip


def producer_keys() -> list[str]:
    """Key patterns a producer may touch (queues are ``<modality>``, ``<modality>.realtime``
    and their priority lists ``<queue>\\x06\\x16<step>``)."""
    queues = [f"{m}*" for m in MODALITIES]
    return [
        *queues,
        "_kombu.binding*",  # kombu 5.7 also keeps _kombu.binding_permanent.<exchange>
        f"{schema.RESULT_KEY_PREFIX}*",
        f"{schema.FINAL_KEY_PREFIX}*",
        f"{schema.JOB_KEY_PREFIX}*",
        f"{schema.LIVE_PREFIX}*",
        f"{OPEN_PREFIX}*",  # tenants' open requests (shared.tenant_quota)
    ]


def producer_channels(db: int) -> list[str]:
    """Pubsub channels a producer may use: result notifications and kombu's fanout channel
    for task events (``fanout_prefix``: ``/<db>.celeryev/<routing key>``)."""
    return ["celery-task-meta-*", f"/{db}.celeryev/*"]


def client_subcommands(version: tuple[int, int]) -> list[str]:
    """``CLIENT`` subcommands clients send on connect (redis-py: ``SETINFO``, and
    ``MAINT_NOTIFICATIONS`` on RESP3 connections; kombu: ``SETNAME``), to allow explicitly
    where categories do not: Redis 6 has no subcommand categories (all of ``CLIENT`` is
    ``@dangerous`` there) and accepts any subcommand name in a rule; Redis 7 refuses a rule
    naming a subcommand it does not have (``setinfo`` came in 7.2). A subcommand the server
    lacks only answers an error, which redis-py ignores."""
    if version < (7, 0):
        return ["client|setname", "client|setinfo", "client|maint_notifications"]
    if version >= (7, 2):
        return ["client|setname", "client|setinfo"]
    return ["client|setname"]


def rules(role: str, db: int = 0, version: tuple[int, int] = (6, 2)) -> list[str]:
    """The ACL rules of ``role`` (without ``on`` and the password), in ``ACL SETUSER`` form,
    for a Redis server of ``version`` (major, minor).

    Raises:
        ValueError: unknown role.
    """
    client = [f"+{c}" for c in client_subcommands(version)]
    if role == "producer":
        return [
            "resetkeys",
            *(f"~{k}" for k in producer_keys()),
            "resetchannels",
            *(f"&{c}" for c in producer_channels(db)),
            "-@all",
            *(f"+{c}" for c in PRODUCER_COMMANDS),
            *client,
        ]
    # Redis 7 classifies CLIENT's subcommands itself (SETNAME is not @dangerous there).
    connect = client if version < (7, 0) else []
    if role == "worker":
        return ["resetkeys", "~*", "resetchannels", "&*", "+@all", "-@dangerous", *connect]
    if role == "operator":
        return [
            "resetkeys", "~*", "resetchannels", "&*",
            "+@all", "-@dangerous", "+info", *connect,
        ]  # fmt: skip
    if role == ADMIN:
        return ["resetkeys", "~*", "resetchannels", "&*", "+@all"]
    raise ValueError(f"unknown Redis role {role!r}; roles: {', '.join((*ROLES, ADMIN))}")


def password_hash(password: str) -> str:
    """Redis's stored form of a password: ``#`` and its SHA-256 in hex."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def user_lines(
    passwords: Mapping[str, str], db: int = 0, version: tuple[int, int] = (6, 2)
) -> list[str]:
    """``redis.conf`` lines defining every role in ``passwords`` (``admin`` becomes the
    ``default`` user), with hashed passwords, for a server of ``version``."""
    lines = []
    for role, password in passwords.items():
        name = "default" if role == ADMIN else role
        rule = rules(role, db, version)
        lines.append(" ".join(["user", name, "reset", "on", password_hash(password), *rule]))
    return lines


def server_version(binary: str) -> tuple[int, int]:
    """(major, minor) of a ``redis-server`` binary, from ``--version`` (``v=7.0.15 ...``).

    Raises:
        OSError, subprocess.SubprocessError, ValueError: the binary cannot tell.
    """
    import re
    import subprocess

    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    found = re.search(r"v=(\d+)\.(\d+)", out.stdout)
    if not found:
        raise ValueError(f"{binary} --version printed no version: {out.stdout!r}")
    return int(found.group(1)), int(found.group(2))
