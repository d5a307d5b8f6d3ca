"""The broker side of :class:`producer.client.FleetClient` (mixed into it as
:class:`Publishing`): task messages out (many in pipelined transactions, or one through
kombu), the queue depths and the backpressure check before a submission, the live workers of a
modality.

Import these names from ``producer.client``.

Private kombu/Celery names (read from kombu 5.7.0; ``tests/unit/test_private_names.py``):
    kombu.connection.Connection: _reraise_as_library_errors
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from celery import Celery

from producer.client.push import DepthCheck, Pusher
from producer.client.wire import Outgoing, PayloadBuilder
from shared import keys, tracing
from shared.queue_stats import fleet_headers
from shared.redis_refusal import BROKER_FAULTS, broker_unavailable, reason_of
from shared.schema import Priority, TaskEnvelope
from shared.settings import MODALITIES

if TYPE_CHECKING:
    from shared.clock import RedisClock
    from shared.settings import Settings

__all__ = ["CHUNK", "Outgoing", "Publishing"]  # Outgoing: producer.client.wire's

CHUNK = 250  # requests per MULTI/EXEC transaction of publish_many
BUILD_BATCH = 50  # messages outgoing builds in one PayloadBuilder.build_many call


class Publishing:
    """Publishing and queue state of a :class:`producer.client.FleetClient` (mixed into it):
    reads its ``app`` (the Celery app, its broker pool) and ``settings``."""

    if TYPE_CHECKING:
        app: Celery
        settings: Settings
        clock: RedisClock

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
        """This client's message builder (``producer.client.wire``), made on first use."""
        builder = self.__dict__.get("_payloads")
        if builder is None:
            builder = self.__dict__["_payloads"] = PayloadBuilder(self.app)
        return builder

    def outgoing(
        self,
        envs: Iterable[TaskEnvelope],
        ids: Iterable[str],
        inputs_json: Iterable[bytes | None] | None = None,
    ) -> Iterator[Outgoing]:
        """The messages of validated requests ``envs`` with task ids ``ids``, built as they
        are consumed (``producer.client.wire``, :data:`BUILD_BATCH` at a time), each with its
        ``task-sent`` event when the app sends them (``task_send_sent_event``).
        ``inputs_json``: each request's inputs as its validation wrote them
        (``FleetClient._validated_many``), when the caller has them."""
        builder = self.payloads()
        events = bool(self.app.conf.task_send_sent_event)
        reply_to = self.app.thread_oid
        route = self._routes()
        datas = itertools.repeat(None) if inputs_json is None else inputs_json
        requests = zip(envs, ids, datas, strict=False)
        while part := list(itertools.islice(requests, BUILD_BATCH)):
            yield from builder.build_many(part, route, reply_to, events)

    def _routes(self) -> dict[tuple[str, str], tuple[str, int]]:
        """(modality, priority label) -> (queue, Celery priority), for every pair: made once
        per settings (they are frozen)."""
        cached = self.__dict__.get("_route_table")
        if cached is None or cached[0] is not self.settings:
            prios = {p.label: p.celery_priority(self.settings) for p in Priority}
            table = {
                (modality, label): (keys.queue_for(modality, label), prio)
                for modality in MODALITIES
                for label, prio in prios.items()
            }
            cached = self.__dict__["_route_table"] = (self.settings, table)
        return cached[1]

    def publish_many(
        self,
        messages: Iterable[Outgoing],
        chunk: int = CHUNK,
        check: DepthCheck | None = None,
    ) -> Iterator[int]:
        """Push ``messages`` (from :meth:`outgoing`) in chunks of ``chunk``, one
        ``MULTI``/``EXEC`` transaction each (one round trip) on a pooled broker connection:
        a chunk is on Redis whole or not at all. Yields, after each chunk, how many messages
        are on Redis so far; stop iterating to send no more. Each chunk is built (``messages``
        consumed) while Redis takes the one before it. ``check``: ``submit_many``'s
        queue-length check, asked before the first chunk is built and judged before it is
        sent (``QueueFull``: nothing is sent). All on one connection (``producer.client.push``).

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
        run a task id once and ack the other copy as a duplicate (``workers.batching.completion``).

        A refusal (Redis answered ``OOM``, ``MISCONF``, ``READONLY``, ``NOPERM``) is raised at
        once, never retried: sending it again gets the same answer (``shared.kombu_redis``).

        Raises:
            BrokerUnavailable: Redis refused a chunk (nothing of it applied), or stayed
                unreachable through the retries (the chunks yielded before are on Redis;
                the failing one may be; later ones were not sent). ``reason`` says which.
        """
        conf = self.app.conf
        retry = conf.task_publish_retry  # as Celery's send_task: retry=False, no retries
        policy = dict(conf.task_publish_retry_policy or {}) if retry else {"max_retries": 0}
        try:
            with self.app.pool.acquire(block=True) as conn:
                pusher = Pusher(conn, policy, conf.event_exchange, self.payloads().sent_group)
                try:
                    yield from pusher.chunks(iter(messages), chunk, check)
                finally:
                    pusher.close()
        except BROKER_FAULTS as exc:
            if reason_of(exc) is None:
                raise
            raise broker_unavailable(exc, "could not publish") from exc

    def queue_depth(self, modality: str) -> dict[str, int]:
        """Messages waiting in ``modality``'s queue, per priority class (one round trip).

        Uses a pooled broker connection: cheap enough to call before every submission.

        Raises:
            BrokerUnavailable: Redis refused it or could not be reached.
        """
        names = [p.label for p in Priority]
        prios = [Priority.parse(n).celery_priority(self.settings) for n in names]
        try:
            with self.app.pool.acquire(block=True) as conn:
                client = conn.default_channel.client
                with client.pipeline(transaction=False) as pipe:
                    for name, p in zip(names, prios, strict=True):
                        queue = keys.queue_for(modality, name)
                        pipe.llen(keys.priority_list_key(queue, p))
                    counts = pipe.execute()
        except BROKER_FAULTS as exc:
            if reason_of(exc) is None:
                raise
            raise broker_unavailable(exc, "could not read the queue depth") from exc
        return dict(zip(names, (int(c) for c in counts), strict=True))

    def live_workers(self, modality: str) -> list[str]:
        """Node names of ``modality``'s batching workers that are ready and alive: those
        whose last heartbeat (``fleet:live:<modality>``, written with every lease renewal)
        is younger than ``[redis] lease_s``, both on Redis' clock (``self.clock``; a
        producer or worker whose own clock is off sees the same). One round trip.

        Raises:
            BrokerUnavailable: Redis is unreachable or refused the read (``MISCONF``
                refuses a new connection's first ``PING``).
        """
        since = self.clock.now() - self.settings.redis.lease_s
        try:
            with self.app.pool.acquire(block=True) as conn:
                client = conn.default_channel.client
                nodes = client.zrangebyscore(keys.live_key(modality), since, "+inf")
        except BROKER_FAULTS as exc:
            if reason_of(exc) is None:
                raise
            raise broker_unavailable(exc, "could not read worker liveness") from exc
        return sorted(n.decode() if isinstance(n, bytes) else str(n) for n in nodes)

    def _depth_check(self, envs: Sequence[TaskEnvelope]) -> DepthCheck | None:
        """The queue-length check of a submission of ``envs`` (for :meth:`publish_many`):
        the priority lists of its modalities that have limits. ``None``: none has."""
        limited = []
        for modality in {e.modality for e in envs}:
            cfg = self.settings.modalities.get(modality)
            if cfg is not None and (cfg.max_queue_length or cfg.max_queue_length_by_priority):
                limited.append(modality)
        if not limited:
            return None
        prios = {p.label: p.celery_priority(self.settings) for p in Priority}
        rows = [
            (modality, label, keys.priority_list_key(keys.queue_for(modality, label), step))
            for modality in sorted(limited)
            for label, step in prios.items()
        ]
        return DepthCheck(self.settings, envs, rows)
