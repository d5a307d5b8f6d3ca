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


class _Task:
    send_events = True


class _Req:
    """What ``TaskEvents`` reads of a Celery request, and Celery's own ``send_event``."""

    task = _Task()

    def __init__(self, task_id: str, eventer: object) -> None:
        self.id, self._eventer = task_id, eventer

    def send_event(self, type_: str, **fields: object) -> None:
        self._eventer.send(type_, uuid=self.id, **fields)  # type: ignore[attr-defined]


def test_a_groups_events_are_the_events_celery_would_send() -> None:
    """``TaskEvents.send`` appends, for each request, the event Celery's ``send_event`` would:
    the same keys and values (the clock ticking once per event, in order), the timestamp and
    offset aside; and flushes at the buffer limit as Celery does."""
    from workers.consumer.engine import TaskEvents

    app = Celery("t", broker="memory://", set_as_current=False)
    with app.connection_for_write() as conn:
        dispatcher = app.events.Dispatcher(
            conn, hostname="w@h", enabled=True, buffer_group=["task"]
        )
        sent: list[list[dict[str, object]]] = []
        dispatcher._publish = lambda event, *a, **k: sent.append(list(event))  # type: ignore[method-assign]
        dispatcher.buffer_limit = 6
        reqs = [_Req(f"id{i}", dispatcher) for i in range(3)]
        for r in reqs:
            r.send_event("task-succeeded", result="{}", runtime=0.5)
        TaskEvents().send("task-succeeded", [(r, {"result": "{}", "runtime": 0.5}) for r in reqs])
        assert len(sent) == 1 and len(sent[0]) == 6  # the limit reached: flushed at once
        celery_made, ours = sent[0][:3], sent[0][3:]
        for a, b in zip(celery_made, ours, strict=True):
            assert set(a) == set(b)
            assert {k: a[k] for k in a if k not in ("clock", "timestamp")} == {
                k: b[k] for k in b if k not in ("clock", "timestamp")
            }
        clocks = [e["clock"] for e in sent[0]]
        assert clocks == sorted(clocks) and len(set(clocks)) == 6


def test_a_dispatcher_that_does_not_buffer_gets_celerys_own_send() -> None:
    from workers.consumer.engine import TaskEvents

    app = Celery("t", broker="memory://", set_as_current=False)
    with app.connection_for_write() as conn:
        dispatcher = app.events.Dispatcher(conn, hostname="w@h", enabled=True)
        sent: list[object] = []
        dispatcher._publish = lambda event, *a, **k: sent.append(event)  # type: ignore[method-assign]
        TaskEvents().send("task-failed", [(_Req("x", dispatcher), {"exception": "E()"})])
        assert len(sent) == 1 and sent[0]["uuid"] == "x"  # type: ignore[index]
        assert sent[0]["type"] == "task-failed"  # type: ignore[index]
