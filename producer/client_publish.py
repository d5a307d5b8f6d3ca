"""The broker side of :class:`producer.client.FleetClient` (mixed into it as
:class:`Publishing`): task messages out (many in pipelined transactions, or one through
kombu), the queue depths and the backpressure check before a submission, the live workers of a
modality.

Import these names from ``producer.client``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from celery import Celery

from producer.wire import PayloadBuilder
from shared import keys, tracing
from shared.errors import QueueFull
from shared.ha import WaitingPut
from shared.priority import Priority
from shared.queue_stats import fleet_headers
from shared.redis_client import execute_transaction
from shared.schema import TaskEnvelope

if TYPE_CHECKING:
    from shared.settings import Settings

__all__ = ["CHUNK", "Outgoing", "Publishing"]

CHUNK = 250  # requests per MULTI/EXEC transaction of publish_many


class Outgoing(NamedTuple):
    """One request ready to push: its priority list, its message, its ``task-sent`` event's
    JSON (``None``: no event, ``task_send_sent_event`` off)."""

    key: str
    payload: bytes
    event: bytes | None


class _Nothing:
    """What kombu's ``Connection.ensure`` revives after a reconnect: nothing (each attempt of
    a chunk takes the connection's channel afresh)."""

    def revive(self, channel: Any) -> None:
        """Called with the new channel after a reconnect; nothing to do."""


class Publishing:
    """Publishing and queue state of a :class:`producer.client.FleetClient` (mixed into it):
    reads its ``app`` (the Celery app, its broker pool) and ``settings``."""

    if TYPE_CHECKING:
        app: Celery
        settings: Settings

    def publish(
        self, producer: Any, env: TaskEnvelope, task_id: str, queue: str, celery_priority: int
    ) -> None:
        """Send one task message (Celery protocol 2, with its ``task-sent`` event) through
        kombu's publish: the bench generator's path, one request per call. ``submit`` and
        ``submit_many`` send the same bytes pipelined (:meth:`publish_many`).

        ``app.send_task`` without the result subscription: Celery's ``send_task`` also
        subscribes to the task's result channel on the backend's pubsub (and unsubscribes
        when the returned ``AsyncResult`` is collected), two commands per request that a
        client reading results by polling (``poll``/``wait_all``) never uses; a quarter of
        the bench generator's sending thread, on the cores the workers need. ``get()``
        subscribes when it is called (Celery's ``AsyncResult.get`` reads a result that is
        already stored, then waits on the channel).

        Args:
            producer: a kombu producer from ``app.producer_or_acquire()``.
            env: the validated request; travels as the task's kwargs.
            queue: a queue name from :mod:`shared.keys`; celery_priority: 0 (first) .. 9.

        Raises:
            kombu/redis connection errors, as ``send_task``.
        """
        amqp = self.app.amqp
        name = keys.task_name(env.modality)
        message = amqp.create_task_message(
            task_id,
            name,
            (),
            env.to_kwargs(),
            reply_to=self.app.thread_oid,
            create_sent_event=self.app.conf.task_send_sent_event,
        )
        message.headers.update(fleet_headers(env))
        with (
            tracing.producer_span(message.headers, env.modality, task_id),
            producer.connection._reraise_as_library_errors(),
        ):
            amqp.send_task_message(producer, name, message, queue=queue, priority=celery_priority)

    def payloads(self) -> PayloadBuilder:
        """This client's message builder (``producer.wire``), made on first use."""
        builder = self.__dict__.get("_payloads")
        if builder is None:
            builder = self.__dict__["_payloads"] = PayloadBuilder(self.app)
        return builder

    def outgoing(self, envs: Iterable[TaskEnvelope], ids: Iterable[str]) -> Iterator[Outgoing]:
        """The messages of validated requests ``envs`` with task ids ``ids``, built as they
        are consumed (``producer.wire``), each with its ``task-sent`` event when the app
        sends them (``task_send_sent_event``)."""
        builder = self.payloads()
        events = bool(self.app.conf.task_send_sent_event)
        reply_to = self.app.thread_oid
        prios = {p.label: p.celery_priority(self.settings) for p in Priority}
        for env, task_id in zip(envs, ids, strict=True):
            queue = keys.queue_for(env.modality, env.priority)
            yield Outgoing(
                *builder.build(env, task_id, queue, prios[env.priority], reply_to, events)
            )

    def publish_many(self, messages: Iterable[Outgoing], chunk: int = CHUNK) -> Iterator[int]:
        """Push ``messages`` (from :meth:`outgoing`) in chunks of ``chunk``, one
        ``MULTI``/``EXEC`` transaction each (one round trip) on a pooled broker connection:
        a chunk is on Redis whole or not at all. Yields, after each chunk, how many messages
        are on Redis so far; stop iterating to send no more.

        A chunk is one ``LPUSH`` per list kombu's publish would use (its messages in
        order: ``LPUSH k a b`` is ``LPUSH k a; LPUSH k b``) and one ``PUBLISH`` of the
        chunk's ``task-sent`` events as a group (``PayloadBuilder.sent_group``). Behind
        Sentinel (``wait_replicas``), a chunk is followed by ``WAIT`` on the same
        connection, with the waiter of kombu's publishes on that channel
        (``shared.ha.WaitingPut``): its backoff, and ``ReplicationUncertain`` (the chunk may
        be lost in a failover) retried as a connection error.

        Faults: a connection error retries the chunk as kombu's publish retries a message:
        ``task_publish_retry_policy`` (none when ``task_publish_retry`` is off), through
        kombu's ``Connection.ensure`` (reconnect, next failover URL, the policy's sleeps). A
        chunk whose ``EXEC`` ran but whose reply was lost is then pushed twice: the workers
        run a task id once and ack the other copy as a duplicate (``workers.completion``).

        Raises:
            kombu.exceptions.OperationalError: retries exhausted (the chunks yielded before
                are on Redis; the failing one may be; later ones were not sent).
        """
        conf = self.app.conf
        retry = conf.task_publish_retry  # as Celery's send_task: retry=False, no retries
        policy = dict(conf.task_publish_retry_policy or {}) if retry else {"max_retries": 0}
        sent = 0
        it = iter(messages)
        builder = self.payloads()
        with self.app.pool.acquire(block=True) as conn:
            push = conn.ensure(_Nothing(), _push_chunk, **policy)
            while part := list(itertools.islice(it, chunk)):
                events = [m.event for m in part if m.event is not None]
                group = builder.sent_group(events) if events else None
                push(conn, part, group, conf.event_exchange)
                sent += len(part)
                yield sent

    def queue_depth(self, modality: str) -> dict[str, int]:
        """Messages waiting in ``modality``'s queue, per priority class (one round trip).

        Uses a pooled broker connection: cheap enough to call before every submission.
        """
        names = [p.label for p in Priority]
        prios = [Priority.parse(n).celery_priority(self.settings) for n in names]
        with self.app.pool.acquire(block=True) as conn:
            client = conn.default_channel.client
            with client.pipeline(transaction=False) as pipe:
                for name, p in zip(names, prios, strict=True):
                    queue = keys.queue_for(modality, name)
                    pipe.llen(keys.priority_list_key(queue, p))
                counts = pipe.execute()
        return dict(zip(names, (int(c) for c in counts), strict=True))

    def live_workers(self, modality: str) -> list[str]:
        """Node names of ``modality``'s batching workers that are ready and alive: those
        whose last heartbeat (``fleet:live:<modality>``, written with every lease renewal)
        is younger than ``[redis] lease_s``. One round trip.

        Raises:
            kombu/redis connection errors: Redis is unreachable.
        """
        since = time.time() - self.settings.redis.lease_s
        with self.app.pool.acquire(block=True) as conn:
            client = conn.default_channel.client
            nodes = client.zrangebyscore(keys.live_key(modality), since, "+inf")
        return sorted(n.decode() if isinstance(n, bytes) else str(n) for n in nodes)

    def _check_backpressure(self, envs: Sequence[TaskEnvelope]) -> None:
        """Refuse the whole submission if any queue would pass its configured maximum.

        Raises:
            QueueFull: a modality's total, or one priority's, limit would be exceeded.
        """
        for modality in {e.modality for e in envs}:
            cfg = self.settings.modalities.get(modality)
            if cfg is None or not (cfg.max_queue_length or cfg.max_queue_length_by_priority):
                continue
            depth = self.queue_depth(modality)
            adding = [e for e in envs if e.modality == modality]
            total = sum(depth.values())
            if cfg.max_queue_length and total + len(adding) > cfg.max_queue_length:
                raise QueueFull(
                    f"{modality} queue holds {total} requests; the limit is {cfg.max_queue_length}"
                )
            for prio, limit in cfg.max_queue_length_by_priority.items():
                n = sum(e.priority == prio for e in adding)
                if n and depth.get(prio, 0) + n > limit:
                    raise QueueFull(
                        f"{modality}/{prio} queue holds {depth.get(prio, 0)} requests; "
                        f"the limit is {limit}"
                    )


def _push_chunk(conn: Any, part: list[Outgoing], group: bytes | None, exchange: str) -> None:
    """One transaction on kombu connection ``conn``: ``part``'s pushes, an ``LPUSH`` per
    list, and its events' ``group`` message (on the event ``exchange``'s ``task.sent``
    topics), then ``WAIT`` if the channel waits (:meth:`Publishing.publish_many`)."""
    channel = conn.default_channel
    waiter = channel._put_waiter() if isinstance(channel, WaitingPut) else None
    lists: dict[str, list[bytes]] = {}
    for m in part:
        lists.setdefault(m.key, []).append(m.payload)
    commands: list[tuple[Any, ...]] = [("LPUSH", k, *v) for k, v in lists.items()]
    if group is not None:  # kombu's fanout topics (its _put_fanout's)
        topics = channel._get_publish_topics(exchange, "task.sent")
        commands += [("PUBLISH", t, group) for t in topics]
    # the channel's cached client (queue_depth's): kombu's conn_or_acquire builds a
    # redis.Redis per call, which cost more than packing the chunk
    execute_transaction(channel.client, commands, waiter)
