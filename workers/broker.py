"""A Redis transport that fills the prefetch window several messages per round trip.

kombu's Redis transport fetches one message per ``BRPOP`` and then records it in the unacked
hash with one more round trip (``QoS.append``), both on the worker's event-loop thread. A
worker with a 256-message window behind a backlog therefore spends two Redis round trips,
and a loop turn, per request: profiled under ``text-saturate``, that fetch was ~60 % of the
loop thread's CPU, on a 2-core machine where the model thread wants every cycle.

:class:`Channel` keeps the blocking ``BRPOP`` (so an idle worker still wakes on the first
message), and when it returns, takes up to the window's free slots more from the same keys in
one atomic Lua script (keys in the order ``BRPOP`` was given them: priority first, so nothing
of lower priority is taken while higher waits). All the messages taken are recorded as unacked
in one pipeline *before* any of them reaches Celery, so an ack (even one sent from inside the
handler, for a request that fails at once) always finds its entry; then each message goes to
its consumer exactly as kombu's own delivery would (``virtual.Channel.basic_consume``).

Relies on kombu's Redis channel internals (``_brpop_read``, ``_q_for_pri``, ``_queue_cycle``,
``QoS.unacked_key``), kombu 5.5 to 5.7, the range pinned in ``pyproject.toml``. Where it
cannot apply (``ack_emulation`` off, a ``global_keyprefix``, a ``no_ack`` consumer) it
delivers as kombu does.

Transport options (Celery ``broker_transport_options``):
    fetch_limit: most messages taken per round trip (default 64; 1 = kombu's behaviour).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport.virtual import QoS as VirtualQoS
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

log = logging.getLogger("fleet.broker")

# Pops up to ARGV[1] items, walking KEYS in order and emptying each before the next.
# Returns a flat array: key, item, key, item, ... Plain RPOP (no count) works on Redis < 6.2.
_POP_MANY = """
local left = tonumber(ARGV[1])
local out = {}
for _, key in ipairs(KEYS) do
  while left > 0 do
    local item = redis.call('RPOP', key)
    if not item then break end
    out[#out + 1] = key
    out[#out + 1] = item
    left = left - 1
  end
  if left == 0 then break end
end
return out
"""


class Channel(kombu_redis.Channel):
    """kombu's Redis channel, taking up to ``fetch_limit`` messages per round trip."""

    fetch_limit = 64
    from_transport_options = (*kombu_redis.Channel.from_transport_options, "fetch_limit")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._consumers_by_queue: dict[str, tuple[Any, bool]] = {}
        self._pop_many: Any = None
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
        """Up to the window's free slots (less the one BRPOP took) from the same keys."""
        if not self._batchable():
            return []
        free = self.qos.can_consume_max_estimate()
        n = min(self.fetch_limit, free if free is not None else self.fetch_limit) - 1
        queues = self._queue_cycle.consume(len(self.active_queues))
        if n <= 0 or not queues:
            return []
        keys = [self._q_for_pri(q, pri) for pri in self.priority_steps for q in queues]
        try:
            if self._pop_many is None:
                self._pop_many = self.client.register_script(_POP_MANY)
            flat = self._pop_many(keys=keys, args=[n], client=self.client)
        except self.connection_errors:
            # The message BRPOP took is still delivered; the rest wait in Redis.
            log.warning("fetching more messages failed; delivering one", exc_info=True)
            self.client.connection.disconnect()
            return []
        return list(zip(flat[0::2], flat[1::2], strict=True))

    def _batchable(self) -> bool:
        return (
            self.fetch_limit > 1
            and self.ack_emulation
            and not self.global_keyprefix
            and isinstance(self.qos, kombu_redis.QoS)
        )

    def _deliver_many(self, items: list[tuple[bytes, bytes]]) -> None:
        """Record every message as unacked in one pipeline, then hand each to its consumer."""
        staged: list[tuple[str, Any, Any]] = []  # (queue, payload or Message, callback or None)
        for key, raw in items:
            queue = bytes_to_str(key).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(queue)
            payload = loads(bytes_to_str(raw))
            consumer = self._consumers_by_queue.get(queue)
            if consumer is None or consumer[1] or len(items) == 1:
                staged.append((queue, payload, None))  # kombu's own path (it appends itself)
            else:
                staged.append((queue, self.Message(payload, channel=self), consumer[0]))
        messages = [m for _, m, cb in staged if cb is not None]
        if messages:
            self._append_unacked(messages)
            self.fetched_in_batches += len(messages)
        for queue, m, callback in staged:
            if callback is None:
                self.connection._deliver(m, queue)
            else:
                callback(m)

    def _append_unacked(self, messages: list[Any]) -> None:
        """``QoS.append`` for every message, in one pipeline (kombu: one per message)."""
        qos = self.qos
        now = time.time()
        with qos.pipe_or_acquire() as pipe:
            for m in messages:
                info = m.delivery_info
                pipe.zadd(qos.unacked_index_key, {m.delivery_tag: now})
                pipe.hset(
                    qos.unacked_key,
                    m.delivery_tag,
                    dumps([m._raw, info["exchange"], info["routing_key"]]),
                )
            pipe.execute()
        for m in messages:
            VirtualQoS.append(qos, m, m.delivery_tag)


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with :class:`Channel` (``broker_transport`` in Celery)."""

    Channel = Channel
