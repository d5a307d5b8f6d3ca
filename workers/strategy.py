"""A Celery task strategy that hands each received message to the batching engine.

Celery calls a task's *strategy* for every message of that task that enters the worker's
prefetch window; the default strategy executes it in the pool. This one builds the same
:class:`celery.worker.request.Request` (so ids, events, acks and ``inspect`` behave as
usual), sends ``task-received``, and gives the request to :class:`workers.engine.Engine`
instead. Revoked and expired messages are dropped as by the default strategy; ETA and
rate limits are not supported for inference requests (an ETA message is rejected).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery.utils.imports import symbol_by_name
from celery.worker.request import create_request_cls
from celery.worker.strategy import hybrid_to_proto2, proto1_to_proto2

from workers import engine_registry
from workers.events import coalesce_task_events


def batching_strategy(task: Any, app: Any, consumer: Any, **_: Any) -> Callable[..., None]:
    """Return the message handler Celery calls per received message of ``task``."""
    engine = engine_registry.current()
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

    def handler(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **__: Any) -> None:
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
            req.reject(requeue=False)
            return
        engine.on_request(req)

    return handler
