"""``AsyncFleetClient``: the producer API for asyncio services. Never imports torch.

>>> async with AsyncFleetClient.from_url("redis://producer:<password>@host:6390/0") as client:
...     h = await client.submit("text", {"text": "A man is playing a guitar."})
...     (await h.result(timeout_s=5))["dim"]
384

The same requests as :class:`producer.client.FleetClient`'s, byte for byte: both are a
``producer.client.fleet.ClientBase`` (validation, task ids, the queue-length check, the
messages and their ``task-sent`` events, built by ``producer.client.wire``), and both send
each chunk of :data:`~producer.client.fleet.CHUNK` requests as the same commands
(``wire.push_commands``) in one ``MULTI``/``EXEC``. The same errors too: a request refused
before anything is sent (``shared.errors``: ``INVALID_INPUT``, ``QUEUE_FULL``, ...), and
``BrokerUnavailable`` with its ``reason`` when Redis refuses, refuses the credentials
(``AUTH``), is not Redis at all (``NOT_REDIS``) or cannot be reached.

What differs is the I/O: here on ``redis.asyncio`` connections of the client's own
(``shared.redis_client.async_redis_client``; a lost connection is retried by redis-py's
``Retry``, then raised), results awaited on their result channel
(``producer.client.subscriptions``: no polling) through :class:`AsyncResultHandle`.
Behind Sentinel with ``[redis] wait_replicas`` (a publish waits for a replica, ``WAIT`` on
the connection that wrote, with the failover checks of ``shared.redis_client``), submissions
go through the blocking client's path (``fleet.push_messages``) on a thread; everything else
stays on the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

from celery import Celery
from redis.exceptions import WatchError

from producer.client.asyncio_results import AsyncResultHandle, broker_faults
from producer.client.fleet import (
    CHUNK,
    ClientBase,
    Submission,
    SubmitRequest,
    node_names,
    push_messages,
)
from producer.client.results import Revocation
from producer.client.subscriptions import Subscriptions
from producer.client.wire import push_commands, sent_topics
from shared import schema, tenant_quota, tenants
from shared.clock import RedisClock
from shared.redis_client import Waiter, async_redis_client
from shared.schema import Priority
from shared.settings import Settings

__all__ = ["AsyncFleetClient"]


class AsyncFleetClient(ClientBase):
    """Submit inference requests and await their results from asyncio code.

    Args:
        settings: fleet settings (Redis address and password, priorities, limits).
        app: a Celery app to reuse for message templates and result decoding (it opens no
            connection here); built from ``settings`` when omitted.
        role: the Redis ACL user to connect as (``shared.acl``), ``producer`` by default.
        redis: a ``redis.asyncio.Redis`` of the fleet's Redis to use (the caller closes it);
            else the client opens its own pool and :meth:`aclose` closes it.

    Make it anywhere (no connection is opened before the first call); use it on one event
    loop. Close it with :meth:`aclose`, or use it as ``async with``.
    """

    def __init__(
        self,
        settings: Settings,
        app: Celery | None = None,
        *,
        role: str = "producer",
        redis: Any = None,
    ) -> None:
        super().__init__(settings, app, role=role)
        self.clock = RedisClock(None)  # sampled on the event loop (_sample_clock)
        self._own_redis = redis is None
        self.redis = async_redis_client(settings, role) if redis is None else redis
        self.subscriptions = Subscriptions(self.redis)
        self._waits = Waiter.of(settings) is not None  # publishes wait for a replica

    async def __aenter__(self) -> AsyncFleetClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Give back what this client holds: its result subscriptions, its Redis
        connections (when it opened them), its /dev/shm store's mappings and kept files."""
        try:
            await self.subscriptions.close()
            if self._own_redis:
                await self.redis.aclose(close_connection_pool=True)
        finally:
            self._close_store()
            self.app.close()

    # -- submitting -----------------------------------------------------------------------
    async def submit(
        self,
        modality: str,
        inputs: dict[str, Any],
        priority: str = "normal",
        timeout_s: float | None = None,
        task_id: str | None = None,
        model: str | None = None,
        version: str | None = None,
        *,
        tenant: str | None = None,
    ) -> AsyncResultHandle:
        """``FleetClient.submit`` on asyncio: one request (``task_id``: its id, default the
        one :meth:`video_inputs` bound its video input to, else a fresh uuid4; ``model`` and
        ``version``: the model, default the modality's; ``tenant``: who it is for, ``None``
        the default tenant), returned once it is on Redis as its handle. Raises as
        :meth:`submit_many`."""
        request = SubmitRequest(
            modality, inputs, priority, timeout_s, task_id, model, version, tenant
        )
        return (await self.submit_many([request]))[0]

    async def submit_many(self, requests: Iterable[SubmitRequest]) -> list[AsyncResultHandle]:
        """Enqueue many requests: :data:`~producer.client.fleet.CHUNK` per ``MULTI``/``EXEC``.

        Every request is validated, and the queue-length limits checked, before any is sent:
        one invalid request raises and none is sent. Each chunk reaches Redis whole or not
        at all.

        Raises:
            FleetError: an invalid request (see :meth:`envelope`), or ``QueueFull`` when a
                modality's queue holds ``max_queue_length`` messages; nothing is sent.
            TenantQuota: a chunk's tenant has ``max_queued`` requests queued or running:
                that chunk was not sent (the chunks before it were, as their handles in the
                exception's ``submitted`` say).
            BrokerUnavailable: Redis refused a chunk (``reason``: ``OOM``, ``MISCONF``,
                ``READONLY``, ``NOPERM``), refused the credentials (``AUTH``), is not Redis
                (``NOT_REDIS``) or could not be reached (``UNREACHABLE``, after redis-py's
                retries). Requests of the
                chunks sent before are queued (their handles are the exception's
                ``submitted`` attribute); the failing chunk's may be (a lost ``EXEC`` reply);
                the rest were not sent.
        """
        requests = list(requests)
        with broker_faults("could not publish"):
            await self._sample_clock()
        sub = self._submission(requests, self.clock.peek() * 1000.0, AsyncResultHandle)
        try:
            if self._waits:
                await self._push_waiting(sub)
            else:
                await self._push(sub)
        except Exception as exc:
            exc.submitted = sub.handles  # type: ignore[attr-defined]
            raise
        return sub.handles

    async def _push(self, sub: Submission[AsyncResultHandle]) -> None:
        """The queue-length check, then each chunk as one transaction, on the loop."""
        with broker_faults("could not publish"):
            if sub.check is not None:
                sub.check.judge(await self._run(sub.check.commands(), transaction=False))
            topics = sent_topics(self.app, self.settings.redis.db)
            group = self.payloads().sent_group
            while part := list(itertools.islice(sub.messages, CHUNK)):
                events = [m.event for m in part if m.event is not None]
                commands = push_commands(part, group(events) if events else None, topics)
                if any(m.quota for m in part):  # a tenant's max_queued: checked under WATCH
                    await self._push_admitted(tenant_quota.sets_of(part), commands)
                else:
                    await self._run(commands)
                sub.sent(len(sub.handles) + len(part))

    async def _push_admitted(
        self, sets: tenant_quota.Sets, commands: Sequence[tuple[Any, ...]]
    ) -> None:
        """``commands`` (a chunk's pushes) as one transaction once the limited tenants'
        sets, read under ``WATCH`` on its connection, allow the chunk; checked and sent
        again when a worker's release changed a set in between, or the connection failed
        (redis-py raises ``WatchError`` then: the ``WATCH`` died with it). Every try checks
        under a fresh ``WATCH``; one after an ``EXEC`` whose reply was lost first asks
        whether that ``EXEC`` was applied (``shared.tenant_quota.applied``), and sends
        nothing more if so.

        Raises:
            TenantQuota: a tenant's limit would be passed; nothing was sent.
        """
        fresh: list[str] | None = None  # the ids the first EXEC adds, once one was sent
        async with self.redis.pipeline(transaction=True) as pipe:
            for tries in itertools.count(1):
                try:
                    if fresh is None:
                        checks = tenant_quota.check_commands(sets)
                    else:
                        checks = tenant_quota.recheck_commands(sets, fresh)
                    replies = [await pipe.execute_command(*c) for c in checks]
                    if fresh is not None and tenant_quota.applied(sets, fresh, replies):
                        await pipe.reset()  # UNWATCH: the chunk is queued already
                        return
                    tenant_quota.judge(sets, replies)
                    if fresh is None:
                        fresh = tenant_quota.absent(sets, replies)
                    pipe.multi()
                    for command in commands:
                        pipe.execute_command(*command)
                    await pipe.execute()
                    return
                except WatchError:
                    if tries >= tenant_quota.WATCH_TRIES:
                        raise
                    await pipe.reset()

    async def _push_waiting(self, sub: Submission[AsyncResultHandle]) -> None:
        """The blocking client's publish (its ``WAIT`` for a replica) on a thread."""
        counts: list[int] = []

        def push() -> None:
            for n in push_messages(self.app, self.payloads(), sub.messages, CHUNK, sub.check):
                counts.append(n)

        try:
            await asyncio.to_thread(push)
        finally:
            if counts:
                sub.sent(counts[-1])

    async def _run(self, commands: Sequence[tuple[Any, ...]], transaction: bool = True) -> Any:
        """``commands`` in one round trip: a ``MULTI``/``EXEC`` transaction, or a plain
        pipeline; their replies."""
        async with self.redis.pipeline(transaction=transaction) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return await pipe.execute()

    async def _sample_clock(self) -> None:
        """Redis' ``TIME`` into :attr:`clock` when a sample is due (every 15 s)."""
        if self.clock.due():
            sent = time.monotonic()
            reply = await self.redis.time()
            self.clock.observe(reply, sent, time.monotonic())

    # -- queue state, cancelling ----------------------------------------------------------
    async def queue_depth(self, modality: str, model: str | None = None) -> dict[str, int]:
        """Messages waiting in ``modality``'s queue (``model``: a model's), per priority
        class (one round trip).

        Raises:
            BrokerUnavailable: Redis refused it or could not be reached.
        """
        names = [p.label for p in Priority]
        route = None if model is None else self.routes.route_model(modality, model)
        lists = []
        for name in names:
            queue = schema.queue_for(modality, name, route)
            step = Priority.parse(name).celery_priority(self.settings)
            own = tenants.tenant_lists(self.settings, queue, step)
            lists.append([schema.priority_list_key(queue, step), *own])
        with broker_faults("could not read the queue depth"):
            counts = await self._run(
                [("LLEN", k) for keys in lists for k in keys], transaction=False
            )
        found = iter(int(c) for c in counts)
        return {n: sum(next(found) for _ in keys) for n, keys in zip(names, lists, strict=True)}

    async def live_workers(self, modality: str, model: str | None = None) -> list[str]:
        """Node names of ``modality``'s batching workers that are alive: a heartbeat
        (``fleet:live:<modality>``) younger than ``[redis] lease_s`` on Redis' clock, as
        ``FleetClient.live_workers`` reads it (``model``, a table name: those serving it).
        One round trip (two when the clock is due).

        Raises:
            BrokerUnavailable: Redis is unreachable or refused the read.
        """
        with broker_faults("could not read worker liveness"):
            await self._sample_clock()
            since = self.clock.peek() - self.settings.redis.lease_s
            key = schema.live_key(modality, model)
            raw = await self.redis.zrangebyscore(key, since, "+inf")
        return node_names(raw)

    async def cancel(self, task_id: str, reason: str = "cancelled by its producer") -> bool:
        """Cancel a request that has no final result yet: it ends ``REVOKED`` (what
        ``FleetClient.cancel`` writes, in the same optimistic transaction: ``WATCH`` of its
        final marker, then the REVOKED document, the marker and a ``PUBLISH``; redis-py's
        ``transaction`` runs it again when a worker's final write lands in between).

        Returns:
            True if this call cancelled it; False if it already had a final result.

        Raises:
            BrokerUnavailable: Redis refused the transaction (nothing applied) or could not
                be reached.
        """
        revoking = Revocation.of(self.app, self.settings, task_id, reason)

        async def claim(pipe: Any) -> bool:
            if await pipe.exists(revoking.final):
                return False
            pipe.multi()
            for command in revoking.commands():
                pipe.execute_command(*command)
            return True

        with broker_faults(f"could not cancel {task_id}"):
            return bool(
                await self.redis.transaction(claim, revoking.final, value_from_callable=True)
            )
