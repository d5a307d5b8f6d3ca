"""A Redis transport that fills the prefetch window several messages per round trip.

kombu's Redis transport fetches one message per ``BRPOP`` and then records it in the unacked
hash with one more round trip (``QoS.append``), both on the worker's event-loop thread. A
worker with a 256-message window behind a backlog therefore spends two Redis round trips,
and a loop turn, per request: profiled under ``text-saturate``, that fetch was ~60 % of the
loop thread's CPU, on a 2-core machine where the model thread wants every cycle.

:class:`Channel` keeps the blocking ``BRPOP`` (so an idle worker still wakes on the first
message), whose message goes through kombu's own delivery. Besides it, one atomic Lua script
takes up to the window's free slots more from the same keys (in the order ``BRPOP`` was given
them: priority first, so nothing of lower priority is taken while higher waits) and records
each in kombu's unacked hash and index in the same step: a message is never out of its list
without its unacked entry (kombu's own fetch has that gap between ``BRPOP`` and
``QoS.append``), and an ack, even one sent from inside the handler for a request that fails
at once, always finds it. Each message then goes to its consumer, in order, as kombu's
delivery would (``virtual.Channel.basic_consume``).

Relies on kombu's Redis channel internals (``_brpop_read``, ``_q_for_pri``, ``_queue_cycle``,
``unacked_key``, the unacked entry's format), kombu 5.5 to 5.7, the range pinned in
``pyproject.toml``. Where it cannot apply (``ack_emulation`` off, a ``global_keyprefix``, a
``no_ack`` consumer) it delivers as kombu does.

Transport options (Celery ``broker_transport_options``):
    fetch_limit: most messages taken per round trip (default 64; 1 = kombu's behaviour).
    fetch_max_bytes: most payload bytes taken per round trip (default 8 MiB; the first
        message is always taken): large images do not hold Redis for long.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport.virtual import QoS as VirtualQoS
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError as RedisResponseError

from workers import lease

log = logging.getLogger("fleet.broker")

# Takes up to ARGV[1] messages, and at most ARGV[3] bytes of them (always at least one),
# walking the priority lists (all KEYS but the last two) in order and emptying each before
# the next, and records each in kombu's unacked hash and index (the last two KEYS) in the
# same atomic step, so no message is ever out of Redis without its unacked entry. The entry
# is kombu's format, ``[payload, exchange, routing_key]`` with the payload's JSON kept byte
# for byte, scored with ARGV[2] (the worker's clock, as kombu scores it).
# The delivery tag and info are read from the payload's last 4 KiB, where kombu's JSON puts
# ``properties`` (after the body): Redis is single-threaded, and decoding a whole 10 MiB
# payload here would stall every client for tens of milliseconds. Only a small payload
# whose tail does not have them is decoded; one that cannot be read is pushed back where
# it was and the walk stops: kombu's own path takes it next.
# Returns a flat array: key, item, key, item, ...
_TAKE_MANY = """
local n = #KEYS - 2
local hash, index = KEYS[n + 1], KEYS[n + 2]
local left = tonumber(ARGV[1])
local budget = tonumber(ARGV[3] or '0')
local taken = 0
local out = {}
local function props(item)
  local tail = string.sub(item, -4096)
  local tag = string.match(tail, '"delivery_tag"%s*:%s*"([^"\\]+)"')
  local info = string.match(tail, '"delivery_info"%s*:%s*(%b{})')
  if tag and info then
    local ex = string.match(info, '"exchange"%s*:%s*"([^"\\]*)"')
    local rk = string.match(info, '"routing_key"%s*:%s*"([^"\\]*)"')
    if ex and rk then return tag, ex, rk end
  end
  if #item > 65536 then return nil end
  local ok, msg = pcall(cjson.decode, item)
  local p = ok and type(msg) == 'table' and msg['properties']
  local i = type(p) == 'table' and p['delivery_info']
  if type(p) ~= 'table' or type(p['delivery_tag']) ~= 'string' or type(i) ~= 'table' then
    return nil
  end
  return p['delivery_tag'], i['exchange'], i['routing_key']
end
for k = 1, n do
  local key = KEYS[k]
  while left > 0 and (budget <= 0 or taken < budget) do
    local item = redis.call('RPOP', key)
    if not item then break end
    local tag, ex, rk = props(item)
    if not tag then
      redis.call('RPUSH', key, item)
      return out
    end
    local entry = '[' .. item .. ',' .. cjson.encode(ex) .. ',' .. cjson.encode(rk) .. ']'
    redis.call('HSET', hash, tag, entry)
    redis.call('ZADD', index, ARGV[2], tag)
    out[#out + 1] = key
    out[#out + 1] = item
    left = left - 1
    taken = taken + #item
  end
  if left == 0 or (budget > 0 and taken >= budget) then break end
end
return out
"""


class QoS(kombu_redis.QoS):
    """kombu's Redis QoS, reporting what it holds to the process's lease keeper.

    ``restore_at_shutdown`` is off: kombu would push back every message of a channel it
    closes, including after a connection loss, while the engine still runs them (they then
    ran twice). The engine returns what it holds itself (``LeaseKeeper.give_back``), and the
    messages of a worker that dies return when their leases lapse. Without a lease keeper
    (not a batching worker) this is kombu's QoS unchanged.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.restore_at_shutdown = lease.current() is None

    def append(self, message: Any, delivery_tag: str) -> None:
        super().append(message, delivery_tag)
        _hold(delivery_tag)

    def append_recorded(self, message: Any, delivery_tag: str) -> None:
        """Track a message whose unacked entry the fetch script wrote already."""
        VirtualQoS.append(self, message, delivery_tag)
        _hold(delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        super().ack(delivery_tag)
        _release(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        super().reject(delivery_tag, requeue=requeue)
        _release(delivery_tag)


def _hold(tag: str) -> None:
    keeper = lease.current()
    if keeper is not None:
        keeper.hold(tag)


def _release(tag: str) -> None:
    keeper = lease.current()
    if keeper is not None:
        keeper.release([tag])


class Channel(kombu_redis.Channel):
    """kombu's Redis channel, taking up to ``fetch_limit`` messages per round trip."""

    QoS = QoS

    fetch_limit = 64
    fetch_max_bytes = 8 * 2**20  # payload bytes per round trip (the first message always)
    # Messages that arrived in a multi-message fetch, over every channel of this process
    # (the worker's stats); each channel also counts its own in ``fetched_in_batches``.
    fetched_in_batches_total = 0
    from_transport_options = (
        *kombu_redis.Channel.from_transport_options,
        "fetch_limit",
        "fetch_max_bytes",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._consumers_by_queue: dict[str, tuple[Any, bool]] = {}
        self._take_many: Any = None
        self.fetched_in_batches = 0
        super().__init__(*args, **kwargs)

    def basic_consume(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        ret = super().basic_consume(queue, *args, **kwargs)
        callback = kwargs.get("callback", args[1] if len(args) > 1 else None)
        no_ack = bool(kwargs.get("no_ack", args[0] if args else False))
        if callback is not None and queue not in self._fanout_queues:
            self._consumers_by_queue[queue] = (callback, no_ack)
        return ret

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        self._consumers_by_queue.pop(queue, None)
        return super().basic_cancel(consumer_tag)

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        # A new pool needs the kombu Connection's parameters. kombu detaches the transport
        # from that Connection (``transport.client = None``) once it is closed or collected,
        # and a channel it could not close then (on a dead broker, a connection error in one
        # channel's close ends kombu's close loop) is closed again later: its QoS restoring
        # the unacked messages would build a pool and fail with an AttributeError, which no
        # cleanup path ignores and which stops the worker. It is a connection error: the
        # broker connection is gone; the messages stay unacked in Redis and come back.
        if self.connection is None or self.connection.client is None:
            raise RedisConnectionError("broker connection closed")
        return super()._connparams(asynchronous=asynchronous)

    def _brpop_read(self, **options: Any) -> bool:
        try:
            try:
                reply = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                # as kombu does: the next loop turn reconnects
                self.client.connection.disconnect()
                raise
            if not reply:
                raise kombu_redis.Empty()
            items = [(reply[0], reply[1])]
            items += self._take_more()
            self._deliver_many(items)
            return True
        finally:
            self._in_poll = None
            flush = getattr(self, "_flush_brpop_reauth", None)  # kombu >= 5.6
            if flush is not None:
                flush()

    def _take_more(self) -> list[tuple[bytes, bytes]]:
        """Up to the window's free slots (less the one BRPOP took) from the same keys, each
        already recorded as unacked (see ``_TAKE_MANY``)."""
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues or not self._batchable(queues):
            return []
        free = self.qos.can_consume_max_estimate()
        n = min(self.fetch_limit, free if free is not None else self.fetch_limit) - 1
        if n <= 0:
            return []
        keys = [self._q_for_pri(q, pri) for pri in self.priority_steps for q in queues]
        keys += [self.unacked_key, self.unacked_index_key]
        try:
            if self._take_many is None:
                self._take_many = self.client.register_script(_TAKE_MANY)
            flat = self._take_many(
                keys=keys, args=[n, repr(time.time()), self.fetch_max_bytes], client=self.client
            )
        except self.connection_errors:
            # The message BRPOP took is still delivered; the rest wait in Redis.
            log.warning("fetching more messages failed; delivering one", exc_info=True)
            self.client.connection.disconnect()
            return []
        except RedisResponseError as exc:
            # Refused before it ran (NOPERM: an ACL denies scripts; NOSCRIPT after a
            # failover is reloaded by redis-py): nothing was taken; kombu's path goes on.
            log.warning("fetching more messages refused (%s); delivering one", exc)
            return []
        return list(zip(flat[0::2], flat[1::2], strict=True))

    def _batchable(self, queues: list[str]) -> bool:
        """Whether every queue's consumer acks (a ``no_ack`` one would leave the unacked
        entries the script writes behind) and kombu's Redis QoS keeps the unacked state."""
        consumers = [self._consumers_by_queue.get(q) for q in queues]
        return (
            self.fetch_limit > 1
            and self.ack_emulation
            and not self.global_keyprefix
            and isinstance(self.qos, QoS)
            and all(c is not None and not c[1] for c in consumers)
        )

    def _deliver_many(self, items: list[tuple[bytes, bytes]]) -> None:
        """Hand the BRPOP'd message to kombu's own path (which records it as unacked), then
        each message the script took (recorded already) to its consumer, in order."""
        if len(items) > 1:
            self.fetched_in_batches += len(items)
            Channel.fetched_in_batches_total += len(items)
        for i, (key, raw) in enumerate(items):
            queue = bytes_to_str(key).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(queue)
            payload = loads(bytes_to_str(raw))
            if i == 0:
                self.connection._deliver(payload, queue)
                continue
            message = self.Message(payload, channel=self)
            self.qos.append_recorded(message, message.delivery_tag)
            self._consumers_by_queue[queue][0](message)


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with :class:`Channel` (``broker_transport`` in Celery)."""

    Channel = Channel
