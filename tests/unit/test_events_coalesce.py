"""Task events leave in one message per flush interval, not one per event-loop turn."""

from __future__ import annotations

import time

from celery import Celery
from kombu.asynchronous import Hub

from workers.consumer.engine import coalesce_task_events


def test_buffered_task_events_flush_once_after_the_interval() -> None:
    app = Celery("t", broker="memory://", set_as_current=False)
    published: list[object] = []
    with app.connection_for_write() as conn:
        hub = Hub()
        dispatcher = app.events.Dispatcher(
            conn, hostname="w@h", enabled=True, buffer_group=["task"], on_send_buffered=None
        )
        real_publish = dispatcher._publish

        def counting_publish(event: object, *args: object, **kw: object) -> None:
            published.append(event)
            real_publish(event, *args, **kw)

        dispatcher._publish = counting_publish
        assert coalesce_task_events(dispatcher, hub, flush_interval_ms=20, buffer_limit=100)
        for i in range(10):
            dispatcher.send("task-received", uuid=f"id{i}")
        hub.fire_timers()
        assert published == []  # nothing yet: the interval has not passed
        time.sleep(0.03)
        hub.fire_timers()
        assert len(published) == 1  # one task.multi message with all ten
        assert [e["uuid"] for e in published[0]] == [f"id{i}" for i in range(10)]  # type: ignore[index]
        dispatcher.send("task-succeeded", uuid="id0")  # a new interval starts
        time.sleep(0.03)
        hub.fire_timers()
        assert len(published) == 2


def test_buffer_limit_flushes_at_once_and_zero_interval_keeps_celery_behaviour() -> None:
    app = Celery("t", broker="memory://", set_as_current=False)
    with app.connection_for_write() as conn:
        hub = Hub()
        dispatcher = app.events.Dispatcher(
            conn, hostname="w@h", enabled=True, buffer_group=["task"]
        )
        sent: list[object] = []
        dispatcher._publish = lambda event, *a, **k: sent.append(event)  # type: ignore[method-assign]
        coalesce_task_events(dispatcher, hub, flush_interval_ms=1000, buffer_limit=4)
        for i in range(4):
            dispatcher.send("task-started", uuid=f"id{i}")
        assert len(sent) == 1 and len(sent[0]) == 4  # type: ignore[arg-type]
        assert not coalesce_task_events(dispatcher, hub, flush_interval_ms=0, buffer_limit=4)
        assert not coalesce_task_events(dispatcher, None, flush_interval_ms=25, buffer_limit=4)
