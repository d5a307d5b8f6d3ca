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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery.utils.imports import symbol_by_name
from celery.worker.request import create_request_cls
from celery.worker.strategy import hybrid_to_proto2, proto1_to_proto2

from shared.errors import EtaNotSupported, InvalidMessage
from workers.consumer import current
from workers.consumer.events import coalesce_task_events


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
