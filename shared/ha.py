"""kombu transports for a Redis behind Sentinel, whose publishes wait for a replica.

:class:`SentinelTransport` is kombu's own Sentinel transport (the primary found through the
sentinels, connections following a failover) whose ``_put`` sends each message's ``LPUSH``
and a ``WAIT`` in one pipeline on one connection (``shared.redis_client.Waiter``): once a
publish returns, the message is on a replica too, and a failover that follows cannot lose
it. Producers use it as :class:`ProducerSentinelTransport` (Redis' refusals not retried as
lost connections: ``shared.kombu_redis``; ``shared.celery_app``); batching workers use
``workers.consumer.sentinel.SentinelTransport``, which adds their fetch, leases and bell.

kombu takes the ``;``-joined ``sentinel://`` URLs for failover alternates, and when a
connection attempt fails it switches to the next one, re-deriving the transport from the
URL's scheme (``kombu.Connection.switch``): kombu's own Sentinel transport, whose publishes
do not wait and whose workers have no batched fetch or leases.
:func:`pin_sentinel_transport` makes ``sentinel://`` name the fleet's transport in the
process, so a connection keeps it through every switch.

Transport options (Celery ``broker_transport_options``), beside kombu's ``master_name`` and
``sentinel_kwargs``:
    wait_replicas: replicas a publish waits for (0: no ``WAIT``).
    wait_timeout_ms: the longest wait.

Both sides use this module, so it lives in ``shared``, the one place both may import
(``tests/unit/test_import_graph.py``): producers publish through :class:`SentinelChannel`
(``producer.client.wire`` confirms its chunks with the channel's waiter) and pin their
transport (``shared.celery_app``); batching workers mix :class:`WaitingPut` into their own
channel (``workers.consumer.sentinel``: a request a worker sends again waits for a replica
too) and pin theirs (``workers.consumer.app``).

Private kombu/Celery names (read from kombu 5.7.0; ``tests/unit/test_private_names.py``):
    kombu.transport.redis.Channel: _put (overridden), _q_for_pri
    kombu.transport.redis.Channel: _expires (new in 5.7), _publish_batch (a keyword of _put)
    kombu.transport.virtual.base.Channel: _get_message_priority
    kombu.transport: _transport_cache
"""

from __future__ import annotations

from typing import Any

import redis.sentinel
from kombu import transport as kombu_transport
from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps

from shared.kombu_redis import AuthNotRetried, RefusalsNotRetried
from shared.redis_client import Waiter, execute_waiting

__all__ = [
    "BASELINE_TRANSPORT",
    "PRODUCER_TRANSPORT",
    "WORKER_TRANSPORT",
    "ProducerSentinelTransport",
    "SentinelChannel",
    "SentinelTransport",
    "WaitingPut",
    "pin_sentinel_transport",
]


class WaitingPut:
    """A kombu Redis channel mixin: each message's ``LPUSH`` is followed by ``WAIT`` on the
    same connection (one round trip), unless the waiter is backing off."""

    wait_replicas = 0
    wait_timeout_ms = 250
    _waiter: Waiter | None = None

    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        waiter = self._put_waiter()
        ch: Any = self
        if waiter is None or "_publish_batch" in kwargs:
            return super()._put(queue, message, **kwargs)  # type: ignore[misc]
        key = ch._q_for_pri(queue, ch._get_message_priority(message, reverse=False))
        with ch.conn_or_acquire() as client, client.pipeline(transaction=False) as pipe:
            pipe.lpush(key, dumps(message))
            if ch._expires and queue in ch._expires:
                for p in ch.priority_steps:
                    pipe.pexpire(ch._q_for_pri(queue, p), ch._expires[queue])
            # ReplicationUncertain is a connection error: kombu's publish retry sends the
            # message again, to the new primary
            execute_waiting(client, pipe, waiter)

    def _put_waiter(self) -> Waiter | None:
        if self._waiter is None and self.wait_replicas > 0:
            self._waiter = Waiter(int(self.wait_replicas), int(self.wait_timeout_ms))
        return self._waiter


class SentinelChannel(WaitingPut, kombu_redis.SentinelChannel):
    """kombu's Sentinel channel whose publishes wait for a replica."""

    from_transport_options = (
        *kombu_redis.SentinelChannel.from_transport_options,
        "wait_replicas",
        "wait_timeout_ms",
    )


class SentinelTransport(kombu_redis.SentinelTransport):
    """kombu's Sentinel transport with :class:`SentinelChannel`."""

    Channel = SentinelChannel


class ProducerSentinelConnection(AuthNotRetried, redis.sentinel.SentinelManagedConnection):
    """The primary's connection, a refused login not retried (``shared.kombu_redis``)."""


class ProducerSentinelChannel(SentinelChannel):
    """:class:`SentinelChannel` on :class:`ProducerSentinelConnection`."""

    connection_class = ProducerSentinelConnection


class ProducerSentinelTransport(RefusalsNotRetried, SentinelTransport):
    """:class:`SentinelTransport` whose users are told of Redis' refusals and of refused
    credentials at once, not after retrying them as lost connections
    (``shared.kombu_redis``): every app but a worker's."""

    Channel = ProducerSentinelChannel


PRODUCER_TRANSPORT = "shared.ha:ProducerSentinelTransport"
BASELINE_TRANSPORT = "shared.ha:SentinelTransport"  # a plain-Celery (baseline) worker's
WORKER_TRANSPORT = "workers.consumer.sentinel:SentinelTransport"


def pin_sentinel_transport(transport: str = PRODUCER_TRANSPORT) -> None:
    """Make ``sentinel://`` URLs resolve to ``transport`` (``"module:Class"``) in this
    process (module docstring: kombu's failover switch). The worker's transport, once
    pinned, stays: its publishes wait as the producer's do, and it adds the batched fetch
    and leases a worker's consumer needs."""
    aliases = kombu_transport.TRANSPORT_ALIASES
    if aliases.get("sentinel") == WORKER_TRANSPORT and transport != WORKER_TRANSPORT:
        return
    aliases["sentinel"] = transport
    # resolved names are cached by kombu (get_transport_cls)
    kombu_transport._transport_cache.pop("sentinel", None)
