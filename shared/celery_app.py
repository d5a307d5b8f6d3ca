"""The Celery app factory shared by producers and workers.

Decisions (see docs/reliability.md, failure semantics):

- JSON only, both ways (``accept_content`` and ``result_accept_content``):
  a message in any other format (pickle included) is refused by the consumer, never run.
- At-least-once: ``task_acks_late`` (ack after the result is stored),
  ``task_reject_on_worker_lost``, and a Redis ``visibility_timeout`` above the longest task.
- One queue per modality; priorities inside each through the Redis transport's
  ``priority_steps`` (one list per step, 0 served first). REALTIME requests go to the
  modality's ``.realtime`` queue, which workers read on a channel of its own.
- Redis behind Sentinel (``[redis] sentinels``): ``sentinel://`` URLs, kombu's Sentinel
  transport with publishes that ``WAIT`` for a replica (``shared.ha``), Celery's
  ``SentinelBackend``; the master name and the sentinels' password as transport options.
- Task events on (``worker_send_task_events``, ``task_send_sent_event``) so Flower sees
  every request.
- kombu's ``json`` serializer written and read by orjson (:func:`use_fast_json`): the same
  values as kombu's own ``json`` module, at a fraction of its cost (events, message bodies and
  result documents go through it on every request); task events are JSON of the same content
  type, written without the non-finite check (``EVENT_SERIALIZER``).
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from kombu import Queue

from shared import schema
from shared.settings import MODALITIES, Settings

__all__ = ["EVENT_SERIALIZER", "make_app", "sentinel_options", "use_fast_json", "wait_options"]

EVENT_SERIALIZER = "fleet-event-json"  # kombu serializer name of task events (use_fast_json)


def use_fast_json() -> None:
    """Register kombu's ``json`` serializer (content type ``application/json``, UTF-8) again
    with :func:`shared.schema.dumps` and :func:`shared.schema.loads`: orjson, and kombu's own
    functions for what orjson leaves aside (kombu's tagged types, non-finite floats, integers
    beyond 64 bits), so every document reads back as the same value kombu's ``json`` gives.
    The wire stays JSON; only its spelling may differ (no blanks, UTF-8 rather than
    ``\\u`` escapes). Process-wide and idempotent: every app this process makes uses it."""
    from kombu.serialization import register

    # Events (``event_serializer``): the same content type and reader, written without the
    # non-finite walk (shared.schema.dumps_event). Registered before ``json`` so that the
    # content type's name stays ``json`` (kombu names a content type by its last register).
    register(
        EVENT_SERIALIZER,
        schema.dumps_event,
        schema.loads,
        content_type="application/json",
        content_encoding="utf-8",
    )
    register(
        "json",
        schema.dumps,
        schema.loads,
        content_type="application/json",
        content_encoding="utf-8",
    )


def make_app(settings: Settings, name: str = "fleet", *, role: str) -> Celery:
    """Build a configured Celery app (no tasks registered; workers add theirs).

    ``role``: the Redis ACL user the app connects as (``producer``, ``worker``, ``operator``;
    see ``shared.acl``).

    Raises:
        FileNotFoundError: no Redis password is configured (see ``Settings.redis_credentials``).
    """
    url = settings.redis_url(role)
    use_fast_json()
    app = Celery(name, broker=url, backend=url, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        event_serializer=EVENT_SERIALIZER,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        broker_transport_options={
            "visibility_timeout": settings.redis.visibility_timeout_s,
            "priority_steps": schema.PRIORITY_STEPS,
            "queue_order_strategy": "priority",
            # Messages of a crashed worker return once visibility_timeout has passed; scan
            # for them every restore_scan_interval_s (kombu's default scans every 100 s).
            "unacked_restore_interval": settings.redis.restore_scan_interval_s,
            "unacked_restore_throttle": 1,
            **sentinel_options(settings),
            **wait_options(settings),
        },
        result_backend_transport_options={
            "retry_policy": {"timeout": 5.0},
            **sentinel_options(settings),
        },
        result_expires=settings.redis.result_expires_s,
        result_extended=False,
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_queues=[Queue(schema.queue_name(m)) for m in MODALITIES]
        + [Queue(schema.realtime_queue_name(m)) for m in MODALITIES],
        task_routes={schema.task_name(m): {"queue": schema.queue_name(m)} for m in MODALITIES},
        task_default_queue=schema.queue_name("text"),
        task_default_priority=settings.priorities["normal"].celery_priority,
        task_inherit_parent_priority=True,
        broker_connection_retry_on_startup=True,
        worker_cancel_long_running_tasks_on_connection_loss=True,
        enable_utc=True,
    )
    # Every app but a worker's is told of Redis' refusals at once (shared.kombu_redis); a
    # batching worker sets its own transport (workers.consumer.app), a baseline one keeps kombu's.
    if settings.ha:
        from shared.ha import BASELINE_TRANSPORT, PRODUCER_TRANSPORT, pin_sentinel_transport

        transport = PRODUCER_TRANSPORT if role != "worker" else BASELINE_TRANSPORT
        app.conf.broker_transport = transport
        pin_sentinel_transport(transport)  # kept through kombu's failover switch
    elif role != "worker":
        from shared.kombu_redis import PRODUCER_TRANSPORT as PLAIN_TRANSPORT

        app.conf.broker_transport = PLAIN_TRANSPORT
    return app


def sentinel_options(settings: Settings) -> dict[str, Any]:
    """kombu's and Celery's Sentinel transport options (``master_name``, the sentinels'
    password in ``sentinel_kwargs``); empty without sentinels."""
    if not settings.ha:
        return {}
    return {
        "master_name": settings.redis.master_name,
        "sentinel_kwargs": {"password": settings.sentinel_password(), "socket_timeout": 5.0},
    }


def wait_options(settings: Settings) -> dict[str, Any]:
    """The publish's ``WAIT`` options (``shared.ha``); empty without sentinels."""
    if not settings.ha:
        return {}
    r = settings.redis
    return {"wait_replicas": r.wait_replicas, "wait_timeout_ms": r.wait_timeout_ms}
