"""A gateway job's one write: its record and its message, together, once per id.

The job record (``fleet:job:<id>``) says "this id was sent"; the message is what runs it.
Written apart (``SET NX`` first, ``LPUSH`` after), a gateway killed between the two left a
record without a message: the retry docs/gateway.md advises found the record, answered 202, and
the job stayed PENDING until the record expired (a day). So they are one step:

    WATCH fleet:job:<id>; GET fleet:job:<id>          -> a record: the job exists, stop
    MULTI; SET fleet:job:<id> <record> EX <ttl>; LPUSH <queue> <message>; EXEC

``EXEC`` applies both or neither, and only if nobody wrote the record since ``WATCH`` (a
concurrent POST with the same id, on any gateway: its ``EXEC`` then answers nil and this one
reads the record again and returns it). The producer's ACL user may ``WATCH`` but not run
scripts (``shared.acl``), hence the optimistic transaction rather than one ``EVAL``.

Crash points (``producer.gateway.crashpoints``; each is tested by SIGKILLing a real
gateway there, ``tests/integration/test_gateway_crash.py``):

- before ``EXEC`` reached Redis (the /dev/shm inputs written, the record read under
  ``WATCH``, the transaction half sent): Redis holds nothing of the job (a connection's
  ``WATCH`` and its queued ``MULTI`` die with it), so the same id sent again is a new job.
  Its /dev/shm inputs, bound to that id, are reclaimed after the job's final result
  (``[transport] default_ttl_s``) or at ``max_ref_lifetime_s`` if it is never sent again.
- after ``EXEC``: record and message are both on Redis (the AOF logs a transaction whole:
  Redis drops a trailing ``MULTI`` without its ``EXEC`` when it loads a truncated AOF, and
  replicates it whole too), so a retry finds the record and waits for the one message.

Behind Sentinel with ``wait_replicas``, the transaction is followed by ``WAIT`` on its
connection (:func:`commit_waiting`, on a worker thread, as ``FleetClient.publish_many``
does): a short answer while a failover is under way (``ReplicationUncertain``) or a lost
connection retries through kombu's publish retry, and each retry starts again with
``WATCH``/``GET`` on the (new) primary: a transaction that survived the failover is found
there (its record is this call's own, byte for byte: nothing is sent again), one that was
lost with the old primary is sent again.

It runs on the gateway's ``AsyncFleetClient``: :func:`commit` on its ``redis.asyncio``
connections, :func:`commit_waiting` through its Celery app's broker pool (where the client
sends its own submissions behind Sentinel), the message built by its builder
(``ClientBase.message``: the bytes ``submit`` sends). It is not a hook of the client
("publish this request, with these writes, if this key is absent"): what it must keep is the
gateway's, between the reads and the ``EXEC``: the admission check overlapped with the
``WATCH``/``GET`` round trip and judged only for a new job, the crash points the tests stop
at, and ``Attempt.maybe_sent``, which decides whether the job's /dev/shm inputs may be
released. A hook taking each as a callback would be this module behind one more indirection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis

from producer.client.wire import Line, Nothing, Outgoing
from producer.gateway.crashpoints import pause, pause_sync
from shared import tenant_quota

if TYPE_CHECKING:
    from producer.client.fleet import ClientBase

__all__ = ["TRIES", "Attempt", "commit", "commit_waiting"]

TRIES = 5  # WATCH rounds before giving up (each lost one means the record was just written)


@dataclass
class Attempt:
    """One job's commit: its id, record key, record (the JSON ``SET`` writes), the record's
    TTL and the message. ``maybe_sent`` turns true once an ``EXEC`` may have reached Redis:
    the caller then keeps the job's /dev/shm inputs, which the message may name."""

    job_id: str
    key: str
    record: str
    ttl_s: int
    message: Outgoing
    maybe_sent: bool = False

    def writes(self) -> list[tuple[Any, ...]]:
        """The transaction's commands: the record, then the message (and, for a tenant with
        ``max_queued``, its id among the tenant's open requests: ``shared.tenant_quota``)."""
        return [
            ("SET", self.key, self.record, "EX", self.ttl_s),
            *(tenant_quota.add_commands([self.message]) if self.message.quota else ()),
            ("LPUSH", self.message.key, self.message.payload),
        ]

    def quota_sets(self) -> tenant_quota.Sets:
        """The tenant set its push adds to (empty: its tenant has no ``max_queued``)."""
        return tenant_quota.sets_of([self.message]) if self.message.quota else {}


async def commit(aredis: Any, job: Attempt, admit: Callable[[], Awaitable[None]]) -> bytes | None:
    """Write ``job``'s record and message in one transaction unless its id has a record, on
    ``aredis`` (a ``redis.asyncio.Redis``: the gateway client's);
    ``admit`` (the queue-depth read and the admission check) runs while the record is read
    and may refuse. Returns ``None`` when this call made the job, else the record found.

    Raises:
        what ``admit`` raises (nothing written), redis errors (``job.maybe_sent`` says
        whether the transaction may have been applied), ``redis.WatchError`` after
        :data:`TRIES` rounds that each found the record rewritten.
    """
    for _ in range(TRIES):
        async with aredis.pipeline(transaction=True) as pipe:
            sets = job.quota_sets()
            read, admitted = await asyncio.gather(
                _watch_get(pipe, job.key, sets), admit(), return_exceptions=True
            )
            if isinstance(read, BaseException):
                raise read
            found, counts = read
            if found is not None:  # the job exists: a refusal of this copy does not matter
                return found
            if isinstance(admitted, BaseException):
                raise admitted
            if sets:
                tenant_quota.judge(sets, counts)  # TenantQuota: nothing written
            await pause("before-push", job.job_id)
            pipe.multi()
            for command in job.writes():
                pipe.execute_command(*command)
            job.maybe_sent = True
            try:
                await pipe.execute()
            except redis.WatchError:  # the record was written meanwhile: read it
                job.maybe_sent = False
                continue
            except redis.ResponseError:  # refused before EXEC ran (EXECABORT): not applied
                job.maybe_sent = False
                raise
            return None
    raise redis.WatchError(f"the record of job {job.job_id} kept changing")


async def _watch_get(
    pipe: Any, key: str, sets: tenant_quota.Sets
) -> tuple[bytes | None, list[Any]]:
    """``WATCH`` of the record (and of the tenant's set), the record, and the set's counts
    (``shared.tenant_quota.check_commands``' answers; none without a set)."""
    checks = tenant_quota.check_commands(sets) if sets else []
    await pipe.watch(key, *sets)
    found: bytes | None = await pipe.get(key)
    counts: list[Any] = [True, *[await pipe.execute_command(*c) for c in checks[1:]]]
    return found, counts


def commit_waiting(client: ClientBase, job: Attempt) -> bytes | None:
    """:func:`commit` behind Sentinel, on a worker thread: the transaction followed by
    ``WAIT`` for a replica on its connection, retried through a failover with the publish
    retry policy (``task_publish_retry_policy``, as ``publish_many``). Admission was judged
    before. Returns as :func:`commit` (``None``: made here, this call's earlier attempt
    included).

    Raises:
        kombu.exceptions.OperationalError: the retries ran out (the job may be on Redis);
        redis.ResponseError: Redis refused the transaction (nothing applied).
    """
    conf = client.app.conf
    retry = conf.task_publish_retry  # as publish_many: retry=False, no retries
    policy = dict(conf.task_publish_retry_policy or {}) if retry else {"max_retries": 0}
    with client.app.pool.acquire(block=True) as kconn:
        line = Line(kconn)
        try:
            attempt = kconn.ensure(Nothing(), _attempt, **policy)
            found: bytes | None = attempt(kconn, line, job)
            return found
        finally:
            line.close()


def _attempt(_kconn: Any, line: Line, job: Attempt) -> bytes | None:
    """One attempt of :func:`commit_waiting` on ``line``'s connection (dropped on a fault:
    its ``WATCH`` goes with it)."""
    try:
        sets = job.quota_sets()
        checks = tenant_quota.check_commands(sets)[1:] if sets else []
        for _ in range(TRIES):
            read = line.send(
                [("WATCH", job.key, *sets), ("GET", job.key), *checks], atomic=False
            ).replies()
            found = read[1]
            if found is not None:
                line.send([("UNWATCH",)], atomic=False).replies()
                return None if found == job.record.encode() else found
            if sets:  # TenantQuota: nothing written (the connection, its WATCH, dropped)
                tenant_quota.judge(sets, [True, *read[2:]])
            pause_sync("before-push", job.job_id)
            job.maybe_sent = True
            try:
                line.send(job.writes()).replies()  # EXEC, then WAIT (a replica has it)
            except redis.WatchError:
                job.maybe_sent = False
                continue
            except redis.ResponseError:  # refused before EXEC ran (EXECABORT): not applied
                job.maybe_sent = False
                raise
            return None
        raise redis.WatchError(f"the record of job {job.job_id} kept changing")
    except BaseException:
        line.drop()
        raise
