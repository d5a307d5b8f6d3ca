"""Acknowledge a batch's messages in one Redis round trip per channel.

kombu's Redis transport acks one message per round trip (``QoS.ack``: ZREM from the unacked
index + HDEL from the unacked hash, in a pipeline of its own). A batch of N requests would
pay N round trips on the worker's event-loop thread, between fetching the next messages.
:func:`ack_batch` sends the same ZREM + HDEL for every message of a channel in one pipeline,
then does the bookkeeping kombu and Celery do after an ack (the virtual QoS forgets the
delivery tag, the message's state becomes ``ACK``, the request is marked acknowledged), so
the outcome is exactly that of ``Request.acknowledge()`` for each.

It relies on ``kombu.transport.redis.QoS._remove_from_indices(tag, pipe)`` and
``pipe_or_acquire`` (kombu 5.5 to 5.7, the range pinned in ``pyproject.toml``). Anything it does not
recognise (another transport, a message acked already, a ``no_ack`` consumer, a lone
message) goes through ``Request.acknowledge()`` unchanged, and so does a batch whose
pipeline fails (each message then gets its own attempt).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport.virtual import QoS as VirtualQoS

log = logging.getLogger("fleet.acks")


def ack_batch(requests: Iterable[Any]) -> int:
    """Acknowledge Celery requests, one pipeline per Redis channel.

    Args:
        requests: ``celery.worker.request.Request`` objects whose results are stored.

    Returns:
        How many were acked through a shared pipeline (the rest went one by one).
    """
    groups: dict[int, tuple[Any, list[tuple[Any, Any]]]] = {}
    single: list[Any] = []
    for req in requests:
        if req.acknowledged:
            continue
        msg = getattr(req, "message", None)
        qos = getattr(getattr(msg, "channel", None), "qos", None)
        if not isinstance(qos, kombu_redis.QoS) or msg.acknowledged or _no_ack(msg):
            single.append(req)
            continue
        groups.setdefault(id(qos), (qos, []))[1].append((req, msg))
    shared = 0
    for qos, items in groups.values():
        if len(items) == 1:
            single.append(items[0][0])
            continue
        try:
            with qos.pipe_or_acquire() as pipe:
                for _, msg in items:
                    qos._remove_from_indices(msg.delivery_tag, pipe)
                pipe.execute()
        except Exception:  # a broken connection: let each ack try (and log) on its own
            log.warning("batched ack of %d messages failed; acking one by one", len(items),
                        exc_info=True)  # fmt: skip
            single.extend(req for req, _ in items)
            continue
        for req, msg in items:
            VirtualQoS.ack(qos, msg.delivery_tag)
            msg._state = "ACK"
            req.acknowledged = True
        shared += len(items)
    for req in single:
        req.acknowledge()
    return shared


def _no_ack(msg: Any) -> bool:
    consumers = getattr(msg.channel, "no_ack_consumers", None)
    tag = (msg.delivery_info or {}).get("consumer_tag")
    return bool(consumers) and tag in consumers
