"""kombu's Redis transport for producers, with Redis' refusals told apart from lost
connections.

kombu's Redis transport declares no ``recoverable_connection_errors``, so kombu falls back to
"every error of the transport is a recoverable connection error", ``ResponseError``
included: a publish that Redis refuses (``OOM``, ``MISCONF``, ``READONLY``, ``NOPERM``) is
retried as a lost connection, through ``Connection.ensure`` (a reconnect and the publish
retry policy's sleeps: 0.6 s) or, when the refusal comes from a new channel's ``PING``
(``MISCONF`` refuses ``PING``), through the connection's own retry (2 s, then 4 s: 6 s per
call). Each retry meets the same refusal. :class:`RefusalsNotRetried` declares the
classification: connection errors (refused, reset, timed out, a node loading its data) are
recoverable, as before; a ``ResponseError`` is neither, so it reaches the caller at once
(``shared.redis_refusal`` names it).

Producers' Celery apps use :data:`PRODUCER_TRANSPORT` (``shared.celery_app``); behind
Sentinel, ``shared.ha.SentinelTransport`` has the same classification. Workers keep their
own transports (``workers.consumer.channel``).
"""

from __future__ import annotations

from kombu.transport import redis as kombu_redis

__all__ = ["PRODUCER_TRANSPORT", "RefusalsNotRetried", "Transport"]


class RefusalsNotRetried:
    """A kombu Redis transport mixin: its connection errors are recoverable (a reconnect and
    the retry policy), its channel errors (``ResponseError``, ``DataError``, a protocol
    error) are not retried at all."""

    recoverable_connection_errors = kombu_redis.Transport.connection_errors
    recoverable_channel_errors: tuple[type[BaseException], ...] = ()


class Transport(RefusalsNotRetried, kombu_redis.Transport):
    """kombu's Redis transport, refusals not retried (``broker_transport`` in Celery)."""


PRODUCER_TRANSPORT = "shared.kombu_redis:Transport"
