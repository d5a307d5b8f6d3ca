"""Acknowledge a batch's messages in one Redis round trip, whatever channel delivered them.

kombu's Redis transport acks one message per round trip (``QoS.ack``: ZREM from the unacked
index + HDEL from the unacked hash, in a pipeline of its own) on the channel that delivered
it. :func:`ack_batch` sends the same ZREM + HDEL for every message in one pipeline on the
lease keeper's own connection (``workers.consumer.lease``), so it works from any thread and after
the delivering channel was closed by a connection loss; then it does the bookkeeping kombu and
Celery do after an ack (the channel's QoS forgets the delivery tag and frees its prefetch
slot, the message's state becomes ``ACK``, the request is marked acknowledged), so the
outcome is exactly that of ``Request.acknowledge()`` for each.

Anything it does not recognise (no lease keeper, another transport, a message acked
already, a ``no_ack`` consumer) goes through ``Request.acknowledge()`` unchanged.

:func:`give_back` is the other way out of the window: messages returned to their queues at
once, unrun (shutdown, or results and acks Redis kept refusing).

Private kombu/Celery names (read from kombu 5.7.0; ``tests/unit/test_private_names.py``):
    kombu.message.Message: _state
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from celery.worker import state as worker_state
from kombu.transport import redis as kombu_redis
from kombu.transport.virtual import QoS as VirtualQoS

from workers.consumer import lease
from workers.consumer.lease import LeaseKeeper

if TYPE_CHECKING:
    from workers.batching.telemetry import Tracing


def ack_batch(requests: Iterable[Any], keeper: LeaseKeeper | None = None) -> int:
    """Acknowledge Celery requests in one pipeline.

    Args:
        requests: ``celery.worker.request.Request`` objects whose results are stored.
        keeper: the process's lease keeper (``workers.consumer.lease.current()`` if ``None``).

    Returns:
        How many were acked through the shared pipeline (the rest went one by one).

    Raises:
        redis.RedisError: the shared pipeline failed; none of its messages is acked (the
            caller retries; their leases are still held, so they are not returned).
    """
    keeper = keeper if keeper is not None else lease.current()
    items: list[tuple[Any, Any]] = []
    single: list[Any] = []
    for req in requests:
        if req.acknowledged:
            continue
        msg = getattr(req, "message", None)
        qos = getattr(getattr(msg, "channel", None), "qos", None)
        if (
            keeper is None
            or not isinstance(qos, kombu_redis.QoS)
            or msg.acknowledged
            or _no_ack(msg)
        ):
            single.append(req)
            continue
        items.append((req, msg))
    if items:
        keeper.ack([msg.delivery_tag for _, msg in items])
        for req, msg in items:
            VirtualQoS.ack(msg.channel.qos, msg.delivery_tag)
            msg._state = "ACK"
            req.acknowledged = True
    for req in single:
        req.acknowledge()
    return len(items)


def _no_ack(msg: Any) -> bool:
    consumers = getattr(msg.channel, "no_ack_consumers", None)
    tag = (msg.delivery_info or {}).get("consumer_tag")
    return bool(consumers) and tag in consumers


def give_back(reqs: Iterable[Any], keeper: LeaseKeeper | None, tracing: Tracing) -> int:
    """Return messages to their queues at once, unrun (their prefetch slots are freed).

    Args:
        reqs: ``celery.worker.request.Request`` objects held by this worker; those acked
            already are skipped.
        keeper: the lease keeper that moves them back (``None``: nothing moves them; their
            visibility timeout will).
        tracing: ends each request's span with ``outcome="given_back"``.

    Returns:
        How many were given back (the engine's ``given_back`` counter).
    """
    reqs = list(reqs)
    tags = [r.message.delivery_tag for r in reqs if not r.acknowledged]
    if keeper is not None:
        keeper.give_back(tags)
    for r in reqs:
        if r.acknowledged:
            continue
        qos = getattr(r.message.channel, "qos", None)
        if qos is not None:
            VirtualQoS.ack(qos, r.message.delivery_tag)  # forget it: frees the slot
        r.acknowledged = True  # nothing may ack it any more: another worker owns it
        worker_state.task_ready(r)
        tracing.finished(r, None, outcome="given_back")
    return len(tags)
