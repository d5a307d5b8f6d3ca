"""Coalesce a worker's task events into fewer Redis round trips.

A Celery worker on an event loop buffers task events (``task-received``, ``task-started``,
``task-succeeded``, ...) and flushes them as one ``task.multi`` message, but it schedules
that flush for the very next loop turn after every buffered event (``Consumer.
on_send_event_buffered``), and kombu's Redis transport sends each flush as its own blocking
PUBLISH. With one BRPOP per message, every arriving message then costs a PUBLISH round trip
on the loop thread, a large share of its time (see docs/decisions.md, "Event coalescing").
Here the flush waits up to ``flush_interval_ms`` (or until ``buffer_limit``
events are buffered, Celery's own inline flush), so a batch's events leave together.

Event timestamps are taken when each event is created, so Flower and the bench see the
same times; only their delivery is later, by at most the interval. As with Celery's own
buffer, events still buffered when the worker shuts down are not sent (at most one
interval's worth); results and acks do not depend on them.
"""

from __future__ import annotations

from typing import Any


def coalesce_task_events(
    dispatcher: Any, hub: Any, flush_interval_ms: float, buffer_limit: int
) -> bool:
    """Make ``dispatcher`` (Celery's ``EventDispatcher``) flush buffered task events at most
    every ``flush_interval_ms`` on ``hub`` (the consumer's kombu event loop).

    Returns:
        False, changing nothing, without a hub or an enabled dispatcher, or with an interval
        of 0 (Celery's own behaviour: a flush every loop turn).
    """
    if hub is None or dispatcher is None or not dispatcher.enabled or flush_interval_ms <= 0:
        return False
    delay_s = flush_interval_ms / 1000.0
    pending = False

    def flush() -> None:
        nonlocal pending
        pending = False
        dispatcher.flush()

    def schedule() -> None:
        nonlocal pending
        if not pending:
            pending = True
            hub.call_later(delay_s, flush)

    dispatcher.buffer_limit = buffer_limit
    dispatcher.on_send_buffered = schedule
    return True
