"""The broker side of :class:`producer.client.FleetClient` (mixed into it as
:class:`Publishing`): one task message out, the queue depths and the backpressure check before a
submission, the live workers of a modality.

Import these names from ``producer.client``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from celery import Celery

from shared import keys, tracing
from shared.errors import QueueFull
from shared.priority import Priority
from shared.queue_stats import fleet_headers
from shared.schema import TaskEnvelope

if TYPE_CHECKING:
    from shared.settings import Settings

__all__ = ["Publishing"]


class Publishing:
    """Publishing and queue state of a :class:`producer.client.FleetClient` (mixed into it):
    reads its ``app`` (the Celery app, its broker pool) and ``settings``."""

    if TYPE_CHECKING:
        app: Celery
        settings: Settings

    def publish(
        self, producer: Any, env: TaskEnvelope, task_id: str, queue: str, celery_priority: int
    ) -> None:
        """Send one task message (Celery protocol 2, with its ``task-sent`` event).

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
