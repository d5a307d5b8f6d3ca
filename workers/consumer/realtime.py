"""The REALTIME lane's own consumer: a second channel with its own prefetch window.

A worker's main consumer holds up to ``prefetch_multiplier`` reserved messages; behind a
backlog that window is full of BULK work, and a REALTIME message waiting in Redis cannot
even be fetched until a batch finishes and frees a slot. REALTIME requests therefore travel on
a queue of their own (``<modality>.realtime``, see ``shared.schema``) that this consumer step
reads on a separate channel, so its window is never occupied by lower-priority messages.
Messages go through Celery's own task handler (decoding, JSON-only accept, unknown tasks,
the task's strategy), so a REALTIME request is a task like any other; the engine's REALTIME
lane thread runs it.

Private kombu/Celery names (read from Celery 5.5 to 5.7; ``tests/unit/test_private_names.py``):
    celery.bootsteps.ConsumerStep: _close (overridden)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery import bootsteps
from kombu import Consumer, Queue
from kombu.common import ignore_errors

from shared import schema


def realtime_consumer_step(
    modality: str, prefetch: int, queues: Sequence[str] = ()
) -> type[bootsteps.ConsumerStep]:
    """A consumer bootstep reading ``modality``'s REALTIME queue (``queues``: the REALTIME
    queues of the models the worker serves, ``shared.model_routes``) with its own window."""
    names = list(queues) or [schema.realtime_queue_name(modality)]

    class RealtimeLaneConsumer(bootsteps.ConsumerStep):
        # Start after the Tasks step: the task strategies (our batching handler) exist then.
        requires = ("celery.worker.consumer.tasks:Tasks",)
        name = f"fleet.realtime.{modality}"

        def get_consumers(self, channel: Any) -> list[Consumer]:
            c = self._consumer
            channel.basic_qos(0, prefetch, False)
            return [
                Consumer(
                    channel,
                    queues=[Queue(q) for q in names],
                    on_message=c.create_task_handler(),
                    on_decode_error=c.on_decode_error,
                    accept=["json"],
                )
            ]

        def start(self, c: Any) -> None:
            self._consumer = c
            super().start(c)

        def _close(self, c: Any, cancel_consumers: bool = True) -> None:
            # Celery's ConsumerStep._close ignores errors through ``c.connection``, which is
            # None after a connection loss (the consumer drops it before it restarts the
            # steps): a connection error closing this channel on a dead broker would be an
            # AttributeError that stops the worker. Ignore through the consumer, as Celery's
            # own steps (Tasks, Control) do.
            channels = {consumer.channel for consumer in self.consumers or [] if consumer.channel}
            for consumer in self.consumers or []:
                if cancel_consumers:
                    ignore_errors(c, consumer.cancel)
            for channel in channels:
                ignore_errors(c, channel.close)

    return RealtimeLaneConsumer
