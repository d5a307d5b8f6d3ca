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

Refused credentials are retried too, and at two layers: redis-py files its
``AuthenticationError`` under ``ConnectionError`` (its own retry of a command), and kombu
lists it among its connection errors (a reconnect and the retry policy's sleeps): a wrong
password took seconds to be told (about 12 s from ``FleetClient.submit``), each retry
refused the same way. :class:`CredentialsRefused` takes its place where the producer's
connections log in (:class:`AuthNotRetried`): an error no layer retries, raised ``from``
redis-py's, so that ``shared.redis_refusal`` names it ``AUTH``. A lost connection is retried
as before.

Producers' Celery apps use :data:`PRODUCER_TRANSPORT` (``shared.celery_app``); behind
Sentinel, ``shared.ha.SentinelTransport`` has the same classification. Workers keep their
own transports (``workers.consumer.channel``).
"""

from __future__ import annotations

from kombu.transport import redis as kombu_redis

from shared.redis_client import AuthNotRetried, Connection, CredentialsRefused

__all__ = [
    "PRODUCER_TRANSPORT",
    "AuthNotRetried",
    "Channel",
    "Connection",
    "CredentialsRefused",
    "RefusalsNotRetried",
    "Transport",
]


class RefusalsNotRetried:
    """A kombu Redis transport mixin: its connection errors are recoverable (a reconnect and
    the retry policy), its channel errors (``ResponseError``, ``DataError``, a protocol
    error) are not retried at all."""

    recoverable_connection_errors = kombu_redis.Transport.connection_errors
    recoverable_channel_errors: tuple[type[BaseException], ...] = ()


class Channel(kombu_redis.Channel):
    """kombu's Redis channel on :class:`Connection`."""

    connection_class = Connection


class Transport(RefusalsNotRetried, kombu_redis.Transport):
    """kombu's Redis transport, refusals and refused credentials not retried
    (``broker_transport`` in Celery)."""

    Channel = Channel


PRODUCER_TRANSPORT = "shared.kombu_redis:Transport"
