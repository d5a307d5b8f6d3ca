"""``max_queued``: how many requests a tenant may have queued or running, kept exact in Redis.

Each tenant with a ``[tenants.<name>] max_queued`` has a set of its open requests' task ids,
``fleet:tenant:<name>:open``: a request is in it from the transaction that queues it to the
ack of its message (after its final result is stored, whichever way it ends: a result, an
error, ``DEADLINE_EXCEEDED``, a duplicate copy), or to its cancel. Its size is the tenant's
count.

- **Admit** (producers: ``FleetClient``, ``AsyncFleetClient``, the gateway): before a chunk
  holding such a tenant's requests is pushed, its connection ``WATCH``es the tenant's set and
  reads its size and which of the chunk's ids it holds already (:func:`check_commands`); over
  the limit, nothing is sent (``TENANT_QUOTA``); else the chunk's ``MULTI``/``EXEC`` adds the
  ids with its ``LPUSH``es (:func:`add_commands`), and is sent again from the check when a
  worker's release changed the set in between (``EXEC`` refused by the ``WATCH``). No
  script: the producer's ACL user runs no ``EVAL`` (``shared.acl``). A chunk sent again
  adds no id twice (a set, not a counter).
- **Retry** after a dropped connection (its ``WATCH`` died with it): checked again under a
  fresh ``WATCH`` (:func:`recheck_commands`), and not sent again when the lost ``EXEC`` was
  applied after all (:func:`applied`: one of the ids it added, :func:`absent` at the first
  check, is in its set or has a result), so a chunk is neither queued twice nor let past
  a limit that another producer filled meanwhile.
- **Release** (batch-mode workers, ``workers.consumer.lease.ack_batch``): ``SREM`` of the
  acked requests' ids, in the same ``MULTI``/``EXEC`` as the ack itself (kombu's unacked
  entries): a worker killed before it leaves both, the message comes back (lease) and is
  acked, and released, by whoever settles it. A second copy's ack removes nothing more.
- **Cancel** (``producer.client.results.Revocation``): ``SREM`` of the id from every
  limited tenant's set, in the transaction that stores REVOKED; the worker's ``SREM`` when
  it drains the cancelled message removes nothing more.
- **Redis restarts** keep the sets as they keep the lists (AOF): they are written in the
  same transactions.

Requests of tenants without ``max_queued`` (and of the default tenant, unless it has one)
cost nothing: no ``WATCH``, no set, no ``SREM``. Why a set of ids and not a counter: every
fault above repeats a write (a retried chunk, a redelivered message, two copies of one id),
and a set makes each repeat a no-op; its memory is one id per open request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from shared import schema, tenants
from shared.errors import TenantQuota
from shared.settings import Settings

__all__ = [
    "OPEN_PREFIX",
    "WATCH_TRIES",
    "Quota",
    "Sets",
    "absent",
    "add_commands",
    "applied",
    "check_commands",
    "judge",
    "limits",
    "open_key",
    "quota_of",
    "recheck_commands",
    "release_commands",
    "sets_of",
]

OPEN_PREFIX = "fleet:tenant:"

Quota = tuple[str, int, str]  # (the tenant's set, its max_queued, the request's task id)

Sets = dict[str, tuple[int, list[str]]]  # set -> (max_queued, the part's ids in it)

WATCH_TRIES = 20  # a chunk's check and send, tried again this often when the set changed


def open_key(tenant: str) -> str:
    """The set of ``tenant``'s open (queued or running) task ids."""
    return f"{OPEN_PREFIX}{tenant}:open"


def tenant_of_key(key: str) -> str:
    """The tenant whose set :func:`open_key` named ``key``."""
    return key[len(OPEN_PREFIX) : -len(":open")]


def limits(settings: Settings) -> dict[str, int]:
    """Tenant -> ``max_queued``, for the tenants that have one."""
    return {n: t.max_queued for n, t in settings.tenants.items() if t.max_queued is not None}


def quota_of(settings: Settings, tenant: str | None, task_id: str) -> Quota | None:
    """What the push of a request of ``tenant`` (``None``: the default one) must admit, or
    ``None`` when its tenant has no ``max_queued``."""
    name = tenants.effective(settings, tenant)
    cfg = settings.tenants.get(name)
    if cfg is None or cfg.max_queued is None:
        return None
    return (open_key(name), cfg.max_queued, task_id)


def sets_of(part: Sequence[Any]) -> Sets:
    """The limited tenants' sets a chunk (``producer.client.wire.Outgoing`` items) adds to,
    each with its limit and the chunk's ids for it; empty when none has a :data:`Quota`."""
    sets: Sets = {}
    for m in part:
        if m.quota is not None:
            key, limit, task_id = m.quota
            sets.setdefault(key, (limit, []))[1].append(task_id)
    return sets


def check_commands(sets: Sets) -> list[tuple[Any, ...]]:
    """``WATCH`` of the sets, then per set its size and which of the ids it holds
    (``SMISMEMBER``, Redis 6.2): a plain pipeline, judged by :func:`judge`."""
    commands: list[tuple[Any, ...]] = [("WATCH", *sets)]
    for key, (_, ids) in sets.items():
        commands += [("SCARD", key), ("SMISMEMBER", key, *ids)]
    return commands


def judge(sets: Sets, replies: Sequence[Any]) -> None:
    """Whether the chunk fits every tenant's limit (``replies``: :func:`check_commands`'
    answers, ``WATCH``'s first).

    Raises:
        TenantQuota: which tenant, how many it holds, its limit (nothing of the chunk sent).
    """
    answers = iter(replies[1:])
    for key, (limit, ids) in sets.items():
        held, member = int(next(answers)), next(answers)
        new = len({i for i, m in zip(ids, member, strict=True) if not m})
        if new > 0 and held + new > limit:
            raise TenantQuota(
                f"tenant {tenant_of_key(key)!r} has {held} requests queued or running; "
                f"its max_queued is {limit}"
            )


def absent(sets: Sets, replies: Sequence[Any]) -> list[str]:
    """The chunk's ids that no set held at the check ``replies`` answer
    (:func:`check_commands`'): the ids its ``EXEC`` adds, so the ids whose presence tells
    a later attempt that the ``EXEC`` was applied (:func:`applied`)."""
    answers = iter(replies[1:])
    out: list[str] = []
    for _, (_, ids) in sets.items():
        next(answers)  # SCARD
        out += [i for i, m in zip(ids, next(answers), strict=True) if not m]
    return out


def recheck_commands(sets: Sets, fresh: Sequence[str]) -> list[tuple[Any, ...]]:
    """The check of an attempt after one whose ``EXEC`` may have been applied (its reply
    lost with the connection): :func:`check_commands` under a fresh ``WATCH``, and
    ``EXISTS`` of the results of ``fresh`` (:func:`absent` of the first check), which a
    worker stores before its ack releases an id. Judged by :func:`applied`, then
    :func:`judge` (its replies without the last)."""
    commands = check_commands(sets)
    if fresh:
        commands.append(("EXISTS", *(schema.result_key(i) for i in fresh)))
    return commands


def applied(sets: Sets, fresh: Sequence[str], replies: Sequence[Any]) -> bool:
    """Whether the chunk's earlier ``EXEC`` was applied, from :func:`recheck_commands`'
    ``replies``: one of ``fresh`` is in its set (added by that ``EXEC``: ids are the
    chunk's own), or has a result (a worker ran it and released it since). ``fresh``
    empty (every id was held already): not known, ``False``. The ``EXEC`` adds the ids
    with the chunk's pushes, atomically, so either tells that the pushes happened."""
    if not fresh:
        return False
    new = set(fresh)
    answers = iter(replies[1:])
    for _, (_, ids) in sets.items():
        next(answers)  # SCARD
        if any(m and i in new for i, m in zip(ids, next(answers), strict=True)):
            return True
    return int(replies[-1]) > 0


def add_commands(part: Sequence[Any]) -> list[tuple[Any, ...]]:
    """The ``SADD`` per limited tenant that records a chunk's requests as open (sent in the
    chunk's ``MULTI``/``EXEC``, with its pushes)."""
    return [("SADD", key, *ids) for key, (_, ids) in sets_of(part).items()]


def release_commands(settings: Settings, kwargs_list: Iterable[tuple[str, Any]]) -> list[Any]:
    """The ``SREM`` per limited tenant that releases acked requests: ``kwargs_list`` holds
    each one's ``(task id, task kwargs)``. Empty when none is of a limited tenant."""
    limited = limits(settings)
    if not limited:
        return []
    default = settings.tenancy.default_tenant
    by_key: dict[str, list[str]] = {}
    for task_id, kwargs in kwargs_list:
        name = tenants.kwargs_tenant(kwargs) or default
        if name in limited:
            by_key.setdefault(open_key(name), []).append(task_id)
    return [("SREM", key, *ids) for key, ids in by_key.items()]
