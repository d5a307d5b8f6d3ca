"""A Celery task strategy that hands each received message to the batching engine.

Celery calls a task's *strategy* for every message of that task that enters the worker's
prefetch window; the default strategy executes it in the pool. This one builds the same
:class:`celery.worker.request.Request` (so ids, events, acks and ``inspect`` behave as
usual), sends ``task-received``, and gives the request to :class:`workers.consumer.engine.Engine`
instead. Revoked and expired messages are dropped as by the default strategy. A message
no request can be built from (a body that is not Celery's ``[args, kwargs, embed]``, broken
headers) gets a coded ``INVALID_MESSAGE`` failure and is acked: it must not crash the
consumer (the worker would die on it at every restart). ETA/countdown is not supported for
inference requests: such a message fails ``ETA_NOT_SUPPORTED`` (the producer refuses it at
submit; this covers other clients).

Task events leave coalesced (:func:`coalesce_task_events`): a Celery worker on an event loop buffers
task events (``task-received``, ``task-started``, ``task-succeeded``, ...) and flushes them as one
``task.multi`` message, but it schedules that flush for the very next loop turn after every buffered
event (``Consumer. on_send_event_buffered``), and kombu's Redis transport sends each flush as its
own blocking PUBLISH. With one BRPOP per message, every arriving message then costs a PUBLISH round
trip on the loop thread, a large share of its time (see docs/decisions.md, "Event coalescing"). Here
the flush waits up to ``flush_interval_ms`` (or until ``buffer_limit`` events are buffered, Celery's
own inline flush), so a batch's events leave together.

Event timestamps are taken when each event is created, so Flower and the bench see the
same times; only their delivery is later, by at most the interval. As with Celery's own
buffer, events still buffered when the worker shuts down are not sent (at most one
interval's worth); results and acks do not depend on them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery.utils.imports import symbol_by_name
from celery.worker.request import create_request_cls
from celery.worker.strategy import hybrid_to_proto2, proto1_to_proto2

from shared.errors import EtaNotSupported, InvalidMessage
from workers.consumer import current


def batching_strategy(task: Any, app: Any, consumer: Any, **_: Any) -> Callable[..., None]:
    """Return the message handler Celery calls per received message of ``task``."""
    engine = current.current()
    engine.attach(consumer.hub)
    hostname = consumer.hostname
    eventer = consumer.event_dispatcher
    ev = engine.settings.events
    coalesce_task_events(eventer, consumer.hub, ev.flush_interval_ms, ev.buffer_limit)
    send_events = bool(eventer and eventer.enabled and task.send_events)
    Req = create_request_cls(
        symbol_by_name(task.Request), task, consumer.pool, hostname, eventer, app=app
    )
    revoked = consumer.controller.state.revoked
    build = _request_builder(Req, task, app, consumer, eventer)

    def handler(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **__: Any) -> None:
        try:
            req = build(message, body, ack, reject)
        except Exception as exc:  # a malformed message: fail it, never the consumer
            engine.refuse_message(message, exc)
            return
        if (req.expires or req.id in revoked) and req.revoked():
            return
        if send_events:
            eventer.send(
                "task-received",
                uuid=req.id,
                name=req.name,
                args=req.argsrepr,
                kwargs=req.kwargsrepr,
                root_id=req.root_id,
                parent_id=req.parent_id,
                retries=req.request_dict.get("retries", 0),
            )
        if req.eta:
            engine.refuse(req, EtaNotSupported("ETA/countdown is not supported; submit when due"))
            return
        engine.on_request(req)

    return handler


def _request_builder(
    Req: Any, task: Any, app: Any, consumer: Any, eventer: Any
) -> Callable[[Any, Any, Any, Any], Any]:
    """``build(message, body, ack, reject)``: the message as a ``Req`` (protocol 1 and
    hybrid bodies converted to protocol 2), checked by :func:`_check_shape`."""
    hostname = consumer.hostname

    def build(message: Any, body: Any, ack: Any, reject: Any) -> Any:
        if body is None and "args" not in message.payload:
            body, headers, decoded, utc = (message.body, message.headers, False, True)
        elif "args" in message.payload:
            body, headers, decoded, utc = hybrid_to_proto2(message, message.payload)
        else:
            body, headers, decoded, utc = proto1_to_proto2(message, body)
        req = Req(
            message,
            on_ack=ack,
            on_reject=reject,
            app=app,
            hostname=hostname,
            eventer=eventer,
            task=task,
            connection_errors=consumer.connection_errors,
            body=body,
            headers=headers,
            decoded=decoded,
            utc=utc,
        )
        _check_shape(req)
        return req

    return build


def _check_shape(req: Any) -> None:
    """Touch what the engine reads, so a malformed message fails here, not later.

    Raises:
        InvalidMessage: the id, args or kwargs are not what Celery's protocol 2 sends.
    """
    if not isinstance(req.id, str) or not req.id:
        raise InvalidMessage("the message has no task id")
    if not isinstance(req.args, list | tuple) or not isinstance(req.kwargs, dict):
        raise InvalidMessage("the body is not [args, kwargs, embed]")
    _ = req.eta, req.expires, req.delivery_info  # parsed lazily by Celery: may raise


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
