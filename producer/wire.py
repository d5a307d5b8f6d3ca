"""The exact bytes a request is on Redis, built without kombu's publish path.

A fleet request on Redis is one kombu message (JSON) in one list, the one kombu's Redis
transport would ``LPUSH`` for ``app.send_task``: ``<queue>`` for Celery priority 0, else
``<queue>\\x06\\x16<priority>`` (``shared.keys.priority_list_key``)::

    {"body": base64(JSON [args, kwargs, embed]),
     "content-encoding": "utf-8", "content-type": "application/json",
     "headers": {Celery protocol 2 headers: "task", "id", "lang", ...},
     "properties": {"correlation_id", "reply_to", "delivery_mode": 2,
                    "delivery_info": {"exchange": "", "routing_key": <queue>},
                    "priority": <0..9>, "body_encoding": "base64", "delivery_tag": <uuid4>}}

``properties`` comes last: the workers' take script reads the delivery tag from the payload's
tail (``workers.broker``). The headers and body are Celery's own
(``app.amqp.create_task_message``), so nothing here re-implements the task protocol.

Why: kombu's publish is synchronous (a thread per in-flight publish for an asyncio caller)
and costs a second round trip for the ``task-sent`` event; the gateway pushes these bytes
with ``redis.asyncio`` in the same round trip as its other commands. Messages built here send
no ``task-sent`` event (Flower shows the request from the worker's ``task-received``).
"""

from __future__ import annotations

import base64
import uuid

from celery import Celery
from kombu.utils.json import dumps

from shared import keys, tracing
from shared.queue_stats import fleet_headers
from shared.schema import TaskEnvelope


def task_payload(
    app: Celery, env: TaskEnvelope, task_id: str, queue: str, celery_priority: int, reply_to: str
) -> tuple[str, bytes]:
    """The Redis list and the message bytes for one request.

    Args:
        app: the producer's Celery app (for Celery's protocol-2 headers and body).
        env: the validated request; travels as the task's kwargs.
        task_id: the task id; queue: a queue name from :mod:`shared.keys`;
        celery_priority: 0 (first) .. 9; reply_to: the producer's reply address (any
            string; the fleet does not reply through it).

    Returns:
        ``(list_key, payload)``: ``LPUSH list_key payload`` enqueues the request.
    """
    # argsrepr/kwargsrepr (what Flower shows) given, not computed: Celery's saferepr of the
    # inputs was a tenth of the gateway's CPU per request; Flower shows the envelope's summary.
    m = app.amqp.create_task_message(
        task_id,
        keys.task_name(env.modality),
        (),
        env.to_kwargs(),
        reply_to=reply_to,
        argsrepr="()",
        kwargsrepr=kwargs_summary(env),
    )
    m.headers.update(fleet_headers(env))
    tracing.inject(m.headers, env.modality, task_id)  # traceparent, when tracing is on
    body = base64.b64encode(dumps(m.body).encode()).decode("ascii")
    message = {
        "body": body,
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": m.headers,
        "properties": {
            **m.properties,
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": celery_priority,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    return keys.priority_list_key(queue, celery_priority), dumps(message).encode()


def kwargs_summary(env: TaskEnvelope) -> str:
    """A short ``kwargsrepr`` for a request (Flower's "kwargs" column): modality, priority,
    model and the input keys, never the inputs themselves."""
    inputs = ", ".join(sorted(env.inputs))
    return (
        f"{{'request': {{'modality': {env.modality!r}, 'priority': {env.priority!r}, "
        f"'model': {env.model!r}, 'inputs': <{inputs}>}}}}"
    )
