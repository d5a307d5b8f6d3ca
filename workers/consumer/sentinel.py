"""The batching workers' transport behind Redis Sentinel (``sentinel://`` broker URLs).

:class:`SentinelChannel` is ``workers.consumer.channel.Channel`` (the batched take from the prefetch
window, leases, the notification bell) on kombu's Sentinel connection pools: every
connection asks the sentinels for the primary when it (re)connects, so a channel that lost
its connection in a failover reaches the promoted replica. Its publishes (a retried
request) wait for a replica as the producer's do (``shared.ha``).
"""

from __future__ import annotations

from kombu.transport import redis as kombu_redis

from shared.ha import WaitingPut
from workers.consumer.channel import Channel, Transport


class SentinelChannel(WaitingPut, kombu_redis.SentinelChannel, Channel):
    """``workers.consumer.channel.Channel`` with kombu's ``SentinelChannel`` pools and waiting
    publishes (module docstring)."""

    from_transport_options = (
        *Channel.from_transport_options,
        "master_name",
        "min_other_sentinels",
        "sentinel_kwargs",
        "sentinel_fanout_compat",
        "wait_replicas",
        "wait_timeout_ms",
    )


class SentinelTransport(Transport):
    """:class:`Transport` with :class:`SentinelChannel` (``sentinel://`` broker URLs)."""

    default_port = 26379
    Channel = SentinelChannel
