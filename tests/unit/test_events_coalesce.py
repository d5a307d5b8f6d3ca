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


class _SoonHub:
    """Records ``call_soon`` as kombu's hub would run it on its next turn."""

    def __init__(self) -> None:
        self.soon: list[object] = []

    def call_soon(self, fn: object, *args: object) -> None:
        self.soon.append(fn)


def test_received_events_leave_together_before_any_later_event_and_keep_their_times() -> None:
    """``defer_received``: a loop turn's ``task-received`` events are sent at its end, one
    group; another event sent earlier sends them first (a request's events keep their order);
    each keeps the time it was deferred at."""
    from workers.consumer.engine import TaskEvents

    app = Celery("t", broker="memory://", set_as_current=False)
    with app.connection_for_write() as conn:
        dispatcher = app.events.Dispatcher(
            conn, hostname="w@h", enabled=True, buffer_group=["task"]
        )
        dispatcher.buffer_limit = 100
        ev, hub = TaskEvents(), _SoonHub()
        reqs = [_Req(f"id{i}", dispatcher) for i in range(3)]
        before = time.time()
        ev.defer_received(reqs[0], {"name": "fleet.text"}, hub)
        ev.defer_received(reqs[1], {"name": "fleet.text"}, hub)
        assert len(hub.soon) == 1  # one flush scheduled for the turn
        buf = dispatcher._group_buffer["task"]
        assert buf == []  # nothing sent yet
        hub.soon[0]()  # type: ignore[operator]
        assert [(e["type"], e["uuid"]) for e in buf] == [
            ("task-received", "id0"),
            ("task-received", "id1"),
        ]
        assert all(before <= e["timestamp"] <= time.time() for e in buf)
        ev.defer_received(reqs[2], {"name": "fleet.text"}, hub)
        ev.send("task-failed", [(reqs[2], {"exception": "E()"})])  # before the turn ends
        assert [(e["type"], e["uuid"]) for e in buf[2:]] == [
            ("task-received", "id2"),
            ("task-failed", "id2"),
        ]
        hub.soon[1]()  # type: ignore[operator]  # the turn's flush finds nothing left
        assert len(buf) == 4
        clocks = [e["clock"] for e in buf]
        assert clocks == sorted(clocks) and len(set(clocks)) == 4
        ev.defer_received(reqs[0], {"name": "fleet.text"}, None)  # no hub: sent at once
        assert buf[-1]["type"] == "task-received" and len(buf) == 5
