"""Arrivals in groups: a take's messages handed to the engine in one call.

kombu delivers each message through its consumer's callback (``Consumer._receive_callback``:
the message's ``accept`` set, its errors checked), which calls Celery's ``on_task_received``
(the task's name read from the headers, its strategy looked up, two ``vine`` promises built
for the ack and the reject), which calls the task's strategy. For a worker taking ~64 messages
per round trip that chain runs per message on the event-loop thread, the thread the worker's
throughput is bound by once the model costs little (docs/decisions.md, "Arrivals in groups").

:class:`FrontDoor` is the receiver the worker's channel hands a take's messages to
(``workers.consumer.channel.install_receiver``). For a message of a task the engine serves
(its strategy registered through :meth:`FrontDoor.serve`) whose body the channel decoded
already (``workers.consumer.channel.Message``), it calls the strategy's arrival directly, with
the same ack and reject callables Celery's promises wrap (the consumer's ``call_soon_ack`` of
the message's ``ack_log_error`` / ``reject_log_error``), and reports the errors Celery's
``on_task_received`` reports the same way (``on_invalid_task``, ``on_decode_error``). Every
other message (another task, a body kombu decodes, a message with errors) goes to its
callback, as before; so does every message while the consumer restores its prefetch count
after a connection restart (Celery then chains its restore onto the ack promises).

Private kombu/Celery names (read from 5.7.0; ``tests/unit/test_private_names.py``):
    kombu.message.Message: _decoded_cache
    celery.worker.consumer.consumer.Consumer: _maximum_prefetch_restored, _new_prefetch_count
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from celery.exceptions import InvalidTaskError
from kombu.exceptions import ContentDisallowed, DecodeError

__all__ = ["FrontDoor"]

Arrive = Callable[[Any, Any, Any, Any], None]  # (message, body, ack, reject)


class FrontDoor:
    """Hands each message of a take to the arrival of its task's strategy."""

    def __init__(self) -> None:
        self._arrivals: dict[str, Arrive] = {}
        self._consumer: Any = None

    def serve(self, task_name: str, arrive: Arrive, consumer: Any) -> None:
        """Take ``task_name``'s messages to ``arrive`` (its strategy's, built by ``consumer``:
        Celery builds the strategies again when its consumer restarts)."""
        self._arrivals[task_name] = arrive
        self._consumer = consumer

    def receive(self, group: list[tuple[Any, Callable[[Any], Any]]]) -> None:
        """Each ``(message, callback)`` of a take, in order (the channel's receiver)."""
        c = self._consumer
        arrivals = self._arrivals
        if c is None or self._restoring(c):
            for message, callback in group:
                callback(message)
            return
        soon = c.call_soon_ack
        partial = functools.partial
        for message, callback in group:
            arrive = None
            if message._decoded_cache is not None and not message.errors:
                headers = message.headers
                if type(headers) is dict:
                    arrive = arrivals.get(headers.get("task"))
            if arrive is None:
                callback(message)
                continue
            try:
                arrive(
                    message,
                    None,
                    partial(soon, message.ack_log_error),
                    partial(soon, message.reject_log_error),
                )
            except (InvalidTaskError, ContentDisallowed) as exc:
                c.on_invalid_task(None, message, exc)
            except DecodeError as exc:
                c.on_decode_error(message, exc)

    @staticmethod
    def _restoring(c: Any) -> bool:
        """Whether Celery restores its prefetch count as acks come (after a restart)."""
        return (
            not c._maximum_prefetch_restored
            and c.restart_count > 0
            and c._new_prefetch_count <= c.max_prefetch_count
        )
