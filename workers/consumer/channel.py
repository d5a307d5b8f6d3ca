"""A Redis transport that fills the prefetch window several messages per round trip.

kombu's Redis transport fetches one message per ``BRPOP`` and then records it in the unacked
hash with one more round trip (``QoS.append``), both on the worker's event-loop thread. A
worker with a 256-message window behind a backlog therefore spends two Redis round trips,
and a loop turn, per request: most of the loop thread's CPU under a backlog, taken from a
model thread that wants every cycle (see docs/decisions.md, "Batched fetch").

:class:`Channel` keeps the blocking ``BRPOP`` (so an idle worker still wakes on the first
message), whose message goes through kombu's own delivery. Besides it, one atomic Lua script
takes up to the window's free slots more from the same keys (in the order ``BRPOP`` was given
them: priority first, so nothing of lower priority is taken while higher waits) and records
each in kombu's unacked hash and index in the same step: a message is never out of its list
without its unacked entry (kombu's own fetch has that gap between ``BRPOP`` and
``QoS.append``), and an ack, even one sent from inside the handler for a request that fails
at once, always finds it. Each message then goes to its consumer, in order, as kombu's
delivery would (``virtual.Channel.basic_consume``).

Relies on kombu's Redis channel internals (the private names listed below, ``unacked_key``,
the unacked entry's format: ``docs/message-layout.md``), as kombu 5.7 has them, the range
pinned in ``pyproject.toml``. Where it cannot apply (``ack_emulation`` off, a
``global_keyprefix``, a ``no_ack`` consumer) it delivers as kombu does.

Transport options (Celery ``broker_transport_options``):
    fetch_limit: most messages taken per round trip (default 64; 1 = kombu's behaviour).
    fetch_max_bytes: most payload bytes taken per round trip (default 8 MiB; the first
        message is always taken): large images do not hold Redis for long.

Redis refusing writes while it answers (``MISCONF``, ``OOM``, ``READONLY``, ``NOPERM``: see
``workers.batching.refusals``) is neither a lost connection nor a reason to exit: a channel
then stops fetching and tries again with backoff, its restore scans wait, and what a new
worker writes to start (queue bindings; ``MISCONF`` refuses even the first ``PING``) is
written once Redis accepts writes again, so that worker gets ready meanwhile.

``workers.consumer.sentinel.SentinelTransport`` is the same behind Redis Sentinel.

Private kombu/Celery names (read from kombu 5.7.0; ``tests/unit/test_private_names.py``):
    kombu.transport.redis.Channel: _brpop_read, _brpop_sent_at (new in 5.7), _brpop_start,
        _connparams, _create_client, _fanout_queues, _flush_brpop_reauth (new in 5.7),
        _get_client, _get_publish_topics, _in_poll, _poll_error, _publish_batch, _put_fanout,
        _q_for_pri, _queue_bind, _queue_cycle, _receive, _size
    kombu.transport.virtual.base.Channel: _tag_to_queue
    kombu.transport.virtual.base.Message: _raw
    kombu.message.Message: _decoded_cache, _state
    kombu.transport.virtual.base.Transport: _deliver
    kombu.transport.redis.MultiChannelPoller: _channels
    redis.connection.AbstractConnection: _sock (redis-py's)

A worker's batching engine installs a *receiver* (:func:`install_receiver`): the messages a
take delivered then go to it in one call, each with its consumer's callback, instead of one
callback each (``workers.consumer.engine.FrontDoor``); it hands a message it does not serve to
that callback. Without one each goes to its callback, as kombu delivers.

The take script is ``take_many.lua`` beside this module (its KEYS, ARGV, reply and the keys it
touches in its header), run by ``Channel._take``; a take Redis refuses before it runs raises
:class:`TakeRefused`.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from importlib import resources
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport.virtual import Message as VirtualMessage
from kombu.transport.virtual import QoS as VirtualQoS
from kombu.utils.encoding import bytes_to_str
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError as RedisResponseError

from shared import clock, schema
from workers.batching import refusals
from workers.batching.refusals import REFUSALS
from workers.consumer import lease
from workers.consumer.tenant_turns import TenantTurns

log = logging.getLogger("fleet.broker")


_NOTIFY_PROBE_S = 1.0  # how long a channel waits for its probe's keyspace notification

# Given a take's messages in order, each with its consumer's callback (kombu's
# ``Consumer._receive_callback``), handles them all: those it does not serve go to their
# callbacks, in order.
Receiver = Callable[[list[tuple[Any, Callable[[Any], Any]]]], None]
_receiver: Receiver | None = None


def install_receiver(receiver: Receiver | None) -> None:
    """Deliver every take's messages to ``receiver`` at once (``None``: one callback each)."""
    global _receiver
    _receiver = receiver


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

    def restore_visible(self, *args: Any, **kwargs: Any) -> Any:
        """kombu's restore scan, which returns the messages of lapsed leases. With leases it
        waits while Redis refuses writes and for a lease period after
        (``Refusals.scans_allowed``): no holder could renew meanwhile, so live workers' leases
        look lapsed until they renew. A refusal of the scan's own write (its mutex) is
        recorded, not raised: Celery would end the worker on it (at start-up, from
        ``on_poll_init``; later as an error in a timer)."""
        if lease.current() is not None and not REFUSALS.scans_allowed():
            return None
        try:
            out = super().restore_visible(*args, **kwargs)
        except RedisResponseError as exc:
            reason = refusals.reason_of(exc)
            if reason is None:
                raise
            REFUSALS.refused("scan", reason, exc)
            return None
        REFUSALS.accepted("scan")
        return out


def _hold(tag: str) -> None:
    keeper = lease.current()
    if keeper is not None:
        keeper.hold(tag)


def _release(tag: str) -> None:
    keeper = lease.current()
    if keeper is not None:
        keeper.release([tag])


class Message(VirtualMessage):
    """kombu's Redis message, built with less work for the common one: a base64 body of
    ``application/json`` in UTF-8 without compression (what Celery and the fleet's producer
    send), its body decoded once here (:func:`shared.schema.loads`, the reader the fleet
    registers for kombu's ``json``) and cached as kombu's ``decode()`` would cache it, so
    Celery's request reads it without kombu's serializer registry. Any other message, or one
    whose body does not decode, is built by kombu unchanged (and fails there as before).
    The fleet's apps accept JSON alone (``shared.celery_app``): the body decoded here is one
    kombu's ``accept`` check would let through."""

    def __init__(self, payload: Any, channel: Any = None, **kwargs: Any) -> None:
        try:
            props = payload["properties"]
            headers = payload.get("headers") or {}
            body = payload.get("body")
            if (
                kwargs
                or type(body) is not str
                or not body
                or props.get("body_encoding") != "base64"
                or headers.get("compression")
                or payload.get("content-type") != _JSON
                or payload.get("content-encoding") != "utf-8"
                or not isinstance(headers, dict)
                or not isinstance(props, dict)
            ):
                raise _Plain()
            raw = base64.b64decode(body)
            decoded = schema.loads(raw)
        except (_Plain, KeyError, TypeError, ValueError, binascii.Error):
            super().__init__(payload, channel=channel, **kwargs)
            return
        self._raw = payload
        self.errors = []
        self.channel = channel
        self.delivery_tag = props["delivery_tag"]
        self.content_type = _JSON
        self.content_encoding = "utf-8"
        self.delivery_info = props.get("delivery_info") or {}
        self.headers = headers
        self.properties = props
        self._decoded_cache = decoded
        self._state = "RECEIVED"
        self.accept = None
        self.body = raw


_JSON = "application/json"


class _Plain(Exception):
    """Not a message :class:`Message` builds itself: kombu builds it."""


class Channel(kombu_redis.Channel):
    """kombu's Redis channel, taking up to ``fetch_limit`` messages per round trip."""

    QoS = QoS
    Message = Message

    fetch_limit = 64
    fetch_max_bytes = 8 * 2**20  # payload bytes per round trip (the first message always)
    # Messages that arrived in a multi-message fetch, over every channel of this process
    # (the worker's stats); each channel also counts its own in ``fetched_in_batches``.
    fetched_in_batches_total = 0
    fetch_notify = True  # wait on push notifications instead of BRPOP where the server can
    # [tenants] with lists of their own (shared.tenants): their names, in order, and each
    # tenant's weight in the take's turns (workers.consumer.tenant_turns); none: as kombu
    tenant_names: tuple[str, ...] = ()
    tenant_weights: dict[str, float] | None = None
    from_transport_options = (
        *kombu_redis.Channel.from_transport_options,
        "fetch_limit",
        "fetch_max_bytes",
        "fetch_notify",
        "tenant_names",
        "tenant_weights",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._consumers_by_queue: dict[str, tuple[Any, bool]] = {}
        self._take_many: Any = None
        self.fetched_in_batches = 0
        self._notify: bool | None = None  # None: not decided yet for this channel
        self._bell_sock: Any = None  # the socket our subscription lives on
        self._maybe_more = True  # the last take filled its request: Redis may hold more
        self._bell_keys: set[bytes] = set()  # lists whose keyspace channel is subscribed
        self._retry_at = 0.0  # monotonic: a refused take is retried from then (by the kick)
        self._last_take = 0.0  # monotonic
        self._unbound: list[tuple[Any, ...]] = []  # queue bindings Redis refused: bound later
        self._turns: TenantTurns | None = None  # made on first use (tenant lists only)
        super().__init__(*args, **kwargs)

    def _get_client(self) -> Any:
        return _answering_client(super()._get_client())

    # -- gap-free fetch: push notifications + the take script ------------------------------
    # BRPOP removes a message from Redis when it replies; until the worker has read that
    # reply and recorded the message as unacked, it exists only in a socket buffer, and a
    # worker killed then loses it. With push notifications (``notify-keyspace-events Kl``)
    # the channel's BRPOP connection instead subscribes to its lists' keyspace channels
    # (pushes wake it; pops, including its own takes', are ignored), and every message is
    # taken by ``TAKE_MANY``, which pops and records in one atomic step: no message is ever
    # out of Redis without its unacked entry. A PING on the subscribed connection wakes the
    # channel when Redis may still hold messages (its last take was full) and nothing new is
    # pushed. Without the server setting, or for channels the script cannot serve, kombu's
    # BRPOP is used as before.
    def _notify_usable(self) -> bool:
        if self._notify is None:
            if time.monotonic() < self._retry_at:
                return False  # the probe was refused: tried again once the retry is due
            self._notify = self.fetch_notify and self._server_notifies()  # None: undecided
        queues = list(self.active_queues)
        return self._notify and bool(queues) and self._batchable(queues)

    def _server_notifies(self) -> bool | None:
        """Whether Redis sends list keyspace notifications, found by trying: subscribe to a
        probe key's channel, push and delete it, wait for the event. No ``CONFIG`` (the
        worker's ACL user may not run it; managed Redis services often refuse it). ``None``:
        Redis refuses writes (the push), so it cannot tell yet; asked again after a backoff,
        not answered "no" for good (that would fetch with BRPOP for the worker's life)."""
        probe = f"{schema.NOTIFY_PROBE_PREFIX}{uuid.uuid4().hex}"
        try:
            with self.conn_or_acquire() as client:
                db = client.connection_pool.connection_kwargs.get("db", 0)
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                try:
                    pubsub.subscribe(f"__keyspace@{db}__:{probe}")
                    client.lpush(probe, 1)
                    client.delete(probe)
                    deadline = time.monotonic() + _NOTIFY_PROBE_S
                    while time.monotonic() < deadline:
                        if pubsub.get_message(timeout=0.05) is not None:
                            return True
                finally:
                    pubsub.close()
        except Exception as exc:
            if refusals.reason_of(exc) is not None:
                self._refused(exc)
                return None
            log.warning("cannot probe keyspace notifications (%s); fetching with BRPOP", exc)
            return False
        log.warning(
            "Redis sends no list keyspace notifications (notify-keyspace-events needs K and "
            "l): fetching with BRPOP, which loses the message in flight when a worker is killed"
        )
        return False

    def _brpop_start(self, timeout: Any = None) -> None:
        if not self._notify_usable():
            if self._notify is None or self._fetch_held(time.monotonic()):
                return  # nothing sent: kombu asks again at the next loop turn
            if self.tenant_names:  # kombu's BRPOP, on the tenant lists too
                return self._brpop_tenanted(timeout)
            return super()._brpop_start(timeout)
        conn = self.client.connection
        if conn._sock is None:
            conn.connect()
        if self._bell_sock is not conn._sock:  # a new connection: subscribe it
            self._bell_keys = set()
            self._bell_sock = conn._sock
            self._subscribe_keys(conn)
            self._maybe_more = True
        elif self._maybe_more and time.monotonic() >= self._retry_at:
            conn.send_command("PING")  # wakes this channel's read: take what is waiting
        self._in_poll = conn
        self._brpop_sent_at = None  # no reply is due: kombu's BRPOP health check skips it

    def _subscribe_keys(self, conn: Any) -> None:
        """Subscribe to the keyspace channel of every list this channel takes from (a
        queue added later is subscribed on the next read)."""
        want = self._fetch_keyset()
        new = want - self._bell_keys
        if new:
            db = self.client.connection_pool.connection_kwargs.get("db", 0)
            conn.send_command("SUBSCRIBE", *(f"__keyspace@{db}__:".encode() + k for k in new))
            self._bell_keys |= new

    def _bell_read(self) -> bool:
        conn = self.client.connection
        try:
            self._subscribe_keys(conn)
            woken = False
            while True:
                # push_request: under RESP3 a push is returned, not skipped while waiting
                reply = conn.read_response(push_request=True)
                woken = woken or _is_wakeup(reply)
                if not conn.can_read(timeout=0):
                    break
        except self.connection_errors:
            conn.disconnect()
            self._bell_sock = None
            raise
        except RedisResponseError as exc:
            # An error reply here answers our PING: Redis refuses it with its writes when it
            # cannot persist (MISCONF). The subscription stands; the take waits (backoff).
            self._refused(exc)
            raise kombu_redis.Empty() from None
        now = time.monotonic()
        if (not woken and not self._maybe_more) or self._fetch_held(now):
            raise kombu_redis.Empty()
        free = self.qos.can_consume_max_estimate()
        want = min(self.fetch_limit, free if free is not None else self.fetch_limit)
        self._last_take = now
        try:
            items = self._take(max(want, 1), self._fetch_client())
        except TakeRefused as exc:  # retried by the next kick, not at every notification
            self._maybe_more, self._retry_at = True, now + KICK_INTERVAL_S
            if exc.reason is not None:
                self._refused(exc.__cause__ or exc)
            raise kombu_redis.Empty() from None
        self._fetched()
        self._maybe_more = len(items) >= want
        if self._maybe_more:  # Redis may hold more: read again once the window has room
            conn.send_command("PING")
        if not items:
            raise kombu_redis.Empty()
        self._deliver_many(items, recorded=True)
        return True

    def _refused(self, exc: BaseException) -> None:
        """Redis refused this channel's fetch with ``exc``: try again after a backoff (and
        report it: ``workers.batching.refusals``). Raises ``exc`` when it is no refusal of
        writes."""
        reason = refusals.reason_of(exc)
        if reason is None:
            raise exc
        self._maybe_more = True
        self._retry_at = time.monotonic() + REFUSALS.refused("fetch", reason, exc)

    def _fetch_held(self, now: float) -> bool:
        """Whether this channel must not fetch now: its last try was refused and the retry
        is not due, or another part of the worker sees Redis refuse writes (what it fetched
        could not be leased, counted or settled; that part's own retries tell when Redis
        accepts writes again)."""
        if now < self._retry_at:
            return True
        if REFUSALS.refusing() and not REFUSALS.refusing("fetch"):
            self._maybe_more, self._retry_at = True, now + KICK_INTERVAL_S
            return True
        return False

    def _fetched(self) -> None:
        """Redis accepted a fetch (a write): bind what it refused to bind before."""
        REFUSALS.accepted("fetch")
        if self._unbound:
            self.bind_refused()

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        # Binding writes a set in Redis; a worker started while Redis refuses writes must
        # still start (Celery ends it on this error) and wait: the binding is written later
        # (the fleet's queues are bound already by anyone who published to them).
        try:
            super()._queue_bind(exchange, routing_key, pattern, queue)
        except RedisResponseError as exc:
            reason = refusals.reason_of(exc)
            if reason is None:
                raise
            REFUSALS.refused("connect", reason, exc)
            self._unbound.append((exchange, routing_key, pattern, queue))

    def bind_refused(self) -> None:
        """Write the queue bindings Redis refused (stops at the first refusal)."""
        while self._unbound:
            exchange, routing_key, pattern, queue = self._unbound[0]
            try:
                kombu_redis.Channel._queue_bind(self, exchange, routing_key, pattern, queue)
            except RedisResponseError as exc:
                if refusals.reason_of(exc) is None:
                    raise
                return
            self._unbound.pop(0)

    def _size(self, queue: str) -> int:
        # kombu counts a queue's lists inside MULTI, which Redis out of memory refuses even
        # for reads (Celery declares, so counts, every queue it consumes at start-up).
        try:
            return int(super()._size(queue))
        except RedisResponseError as exc:
            if refusals.reason_of(exc) is None:
                raise
            with self.conn_or_acquire() as client, client.pipeline(transaction=False) as pipe:
                for pri in self.priority_steps:
                    pipe.llen(self._q_for_pri(queue, pri))
                return sum(int(n or 0) for n in pipe.execute())

    def maybe_refresh_binding_expiry(self) -> None:
        # Refreshes the expiring bindings (Celery's pidbox queue) with a script: a write.
        # kombu logs each refused refresh with its traceback, every second; refreshed once
        # Redis accepts writes again instead (a binding table that expired meanwhile is
        # written again by the refresh).
        if REFUSALS.refusing():
            return
        try:
            super().maybe_refresh_binding_expiry()
        except RedisResponseError as exc:
            reason = refusals.reason_of(exc)
            if reason is None:
                raise
            REFUSALS.refused("connect", reason, exc)

    def _receive(self) -> bool:
        try:
            return bool(super()._receive())
        except RedisResponseError as exc:
            # The fanout subscription's error reply answers a health-check PING, which Redis
            # refuses with its writes under MISCONF: the subscription stands.
            if refusals.reason_of(exc) is None:
                raise
            return False

    def _subscribed(self) -> bool:
        conn = getattr(self.__dict__.get("client"), "connection", None)
        sock = getattr(conn, "_sock", None)
        return sock is not None and sock is self._bell_sock

    def _poll_error(self, type: str, **options: Any) -> Any:
        if type == "BRPOP" and self._subscribed():  # no BRPOP reply to read: reconnect
            self.client.connection.disconnect()
            self._bell_sock = None
            return None
        return super()._poll_error(type, **options)

    def _fetch_keyset(self) -> set[bytes]:
        queues = list(self.active_queues)
        keys = {self._q_for_pri(q, p).encode() for p in self.priority_steps for q in queues}
        if self.tenant_names:
            keys |= {k.encode() for k in self._tenant_keys(queues)}
        return keys

    # -- tenant lists (shared.tenants) ------------------------------------------------------
    def _tenant_turns(self) -> TenantTurns:
        if self._turns is None:
            self._turns = TenantTurns(self.tenant_names, self.tenant_weights or {})
        return self._turns

    def _tenant_keys(self, queues: list[str]) -> list[str]:
        """Every tenant list of ``queues``, over the channel's priority steps."""
        turns = self._tenant_turns()
        return [k for p in self.priority_steps for q in queues for k in turns.lists(q, p)[1:]]

    def _brpop_tenanted(self, timeout: Any = None) -> None:
        """kombu's ``_brpop_start`` with each priority list's tenant lists after it."""
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        turns = self._tenant_turns()
        keys = [k for p in self.priority_steps for q in queues for k in turns.lists(q, p)]
        self._in_poll = self.client.connection
        self._brpop_sent_at = time.monotonic()
        self.client.connection.send_command(
            "BRPOP", *keys, self.brpop_timeout if timeout is None else timeout or 0
        )

    def _put_fanout(self, exchange: str, message: Any, routing_key: str, **kwargs: Any) -> None:
        """kombu's, with the message written by :func:`shared.schema.dumps` (orjson; equal in
        value to kombu's ``json.dumps``, which it falls back to for what orjson refuses): a
        worker's task events leave through here, a flush of up to ``buffer_limit`` of them
        in one message."""
        publish_batch = kwargs.pop("_publish_batch", None)
        topics = self._get_publish_topics(exchange, routing_key)
        payload = schema.dumps(message)
        if publish_batch is not None:
            for topic in topics:
                publish_batch.add("publish", topic, payload)
            return
        with self.conn_or_acquire() as client:
            for topic in topics:
                client.publish(topic, payload)

    @contextlib.contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """kombu's: ``client``, or one on the channel's pool. kombu builds a new client for
        every call (about 85 us: redis-py copies its response callbacks into each), and calls it
        for every ``PUBLISH`` (each flush of task events), ``LPUSH``, ``LLEN``; a client on a
        pool is safe to share between threads (each command takes a pool connection), so one
        is kept per pool."""
        if client:
            yield client
            return
        pool = self.pool
        shared = self.__dict__.get("_shared_client_")
        if shared is None or shared.connection_pool is not pool:
            shared = self.__dict__["_shared_client_"] = self._create_client()
        yield shared

    def _fetch_client(self) -> Any:
        client = self.__dict__.get("_fetch_client_")
        if client is None:
            client = self.__dict__["_fetch_client_"] = self._create_client()
        return client

    def close(self) -> None:
        if self._bell_sock is not None:
            self._in_poll = None  # kombu would read a pending reply: there is none to read
            self._bell_sock = None
        super().close()

    def basic_consume(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        ret = super().basic_consume(queue, *args, **kwargs)
        callback = kwargs.get("callback", args[1] if len(args) > 1 else None)
        no_ack = bool(kwargs.get("no_ack", args[0] if args else False))
        if callback is not None and queue not in self._fanout_queues:
            self._consumers_by_queue[queue] = (callback, no_ack)
        # A queue consumed again (``add_consumer``) may hold messages pushed meanwhile: take
        # now, not at the next push (its keyspace channel is subscribed on that read).
        self._maybe_more = True
        if self._subscribed():
            with contextlib.suppress(*self.connection_errors):  # the read path reconnects
                self.client.connection.send_command("PING")
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
        if self._subscribed():
            try:
                return self._bell_read()
            finally:
                # Stays armed: the subscription is always listening, and kombu pauses an
                # armed socket while the window is full (an unarmed one it would drop).
                self._in_poll = self.client.connection
        try:
            try:
                reply = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                # as kombu does: the next loop turn reconnects
                self.client.connection.disconnect()
                raise
            except RedisResponseError as exc:
                # BRPOP writes: Redis refusing writes refuses it, and a node that becomes a
                # replica unblocks it (UNBLOCKED). Nothing was taken either way.
                if not str(exc).startswith("UNBLOCKED"):
                    self._refused(exc)
                raise kombu_redis.Empty() from None
            self._fetched()
            if not reply:
                raise kombu_redis.Empty()
            items = [(reply[0], reply[1])]
            items += self._take_more()
            self._deliver_many(items)
            return True
        finally:
            self._in_poll = None
            flush = getattr(self, "_flush_brpop_reauth", None)  # kombu >= 5.7
            if flush is not None:
                flush()

    def _take_more(self) -> list[tuple[bytes, bytes]]:
        """Up to the window's free slots (less the one BRPOP took) from the same keys, each
        already recorded as unacked (see ``TAKE_MANY``)."""
        free = self.qos.can_consume_max_estimate()
        n = min(self.fetch_limit, free if free is not None else self.fetch_limit) - 1
        try:
            return self._take(n, self.client)
        except TakeRefused as exc:
            if exc.reason is not None:
                self._refused(exc.__cause__ or exc)
            return []
        except self.connection_errors:
            # The message BRPOP took is still delivered; the rest wait in Redis.
            log.warning("fetching more messages failed; delivering one", exc_info=True)
            self.client.connection.disconnect()
            return []

    def _take(self, n: int, client: Any) -> list[tuple[bytes, bytes]]:
        """Up to ``n`` messages from this channel's queues, recorded as unacked.

        Raises:
            redis.ConnectionError: Redis is unreachable (nothing was taken).
        """
        queues = self._queue_cycle.consume(len(self.active_queues))
        if n <= 0 or not queues or not self._batchable(queues):
            return []
        if self.tenant_names:  # within a step, the tenants' lists in weighted turns
            turns = self._tenant_turns()
            keeper = lease.current()
            if keeper is not None:
                turns.forget(set(keeper.held()))
            keys = [k for pri in self.priority_steps for q in queues for k in turns.next(q, pri)]
        else:
            keys = [self._q_for_pri(q, pri) for pri in self.priority_steps for q in queues]
        keys += [self.unacked_key, self.unacked_index_key]
        try:
            if self._take_many is None:
                self._take_many = client.register_script(TAKE_MANY)
            flat = self._take_many(
                keys=keys, args=[n, repr(clock.now_s()), self.fetch_max_bytes], client=client
            )
        except RedisResponseError as exc:
            # Refused before it ran or at its first write (Redis refusing writes: MISCONF,
            # OOM, READONLY, NOPERM; reported once by workers.batching.refusals; NOSCRIPT after a
            # failover is reloaded by redis-py): nothing was taken.
            reason = refusals.reason_of(exc)
            if reason is None:
                log.warning("fetching messages refused (%s); retrying", exc)
            raise TakeRefused(reason) from exc
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

    def _deliver_many(self, items: list[tuple[bytes, bytes]], recorded: bool = False) -> None:
        """Hand the BRPOP'd message to kombu's own path (which records it as unacked), then
        each message the script took (recorded already) to its consumer, in order.
        ``recorded``: every item came from the script (the notification path)."""
        if len(items) > 1:
            self.fetched_in_batches += len(items)
            Channel.fetched_in_batches_total += len(items)
        turns = self._turns if self.tenant_names else None
        receive = _receiver
        group: list[tuple[Any, Callable[[Any], Any]]] = []
        sep, loads, consumers = self.sep, schema.loads, self._consumers_by_queue
        for i, (key, raw) in enumerate(items):
            queue = bytes_to_str(key).rsplit(sep, 1)[0]
            self._queue_cycle.rotate(queue)
            payload = loads(raw)
            if turns is not None:  # which list the window's message came from
                turns.taken(bytes_to_str(key), payload["properties"]["delivery_tag"])
            if i == 0 and not recorded:
                self.connection._deliver(payload, queue)
                continue
            message = self.Message(payload, channel=self)
            self.qos.append_recorded(message, message.delivery_tag)
            if receive is None:
                consumers[queue][0](message)
            else:
                group.append((message, consumers[queue][0]))
        if group:
            receive(group)  # type: ignore[misc]


KICK_INTERVAL_S = 1.0  # the notification fetch's safety net: see Transport._kick


IDLE_KICK_S = 5.0  # an idle channel takes anyway this often (a missed notification)


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with :class:`Channel` (``broker_transport`` in Celery)."""

    Channel = Channel

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)
        tref = getattr(self, "_kick_tref", None)
        if tref is not None:
            tref.cancel()
        self._kick_tref = loop.call_repeatedly(KICK_INTERVAL_S, self._kick)

    def _kick(self) -> None:
        """Wake waiting notification channels whose take is due without a push: one that
        was refused (an ACL, a failover) or left messages behind, and every idle channel
        every ``IDLE_KICK_S`` (a notification missed while reconnecting)."""
        now = time.monotonic()
        for ch in list(getattr(self.cycle, "_channels", ())):
            if isinstance(ch, Channel) and ch._unbound and not REFUSALS.refusing():
                with contextlib.suppress(*ch.connection_errors):
                    ch.bind_refused()
            if not isinstance(ch, Channel) or ch._bell_sock is None:
                continue
            conn = ch._in_poll
            if not conn or conn._sock is not ch._bell_sock or now < ch._retry_at:
                continue
            if ch._maybe_more or now - ch._last_take >= IDLE_KICK_S:
                try:
                    conn.send_command("PING")
                    ch._last_take = now
                except ch.connection_errors:
                    pass  # the read path reconnects


PUSH_EVENTS = frozenset({b"lpush", b"rpush", b"linsert", b"lmove", b"rpoplpush", b"lset"})


def _is_wakeup(reply: Any) -> bool:
    """Whether a reply on the subscribed connection calls for a take: a push to one of the
    channel's lists (its keyspace channels carry the command's name), or our own PING
    (``[b"pong", b""]`` in RESP2, ``PONG`` in RESP3). Pops (every take's own) and subscribe
    confirmations do not."""
    if reply in (b"PONG", "PONG"):
        return True
    if not isinstance(reply, list | tuple) or not reply:
        return False
    kind = reply[0]
    if kind in (b"message", "message"):
        event = reply[2] if len(reply) > 2 else b""
        return (event if isinstance(event, bytes) else str(event).encode()) in PUSH_EVENTS
    return kind in (b"pong", "pong")


@functools.cache
def _answering_client(base: Any) -> Any:
    """kombu's Redis client class (``base``) whose ``ping`` takes a ``MISCONF`` refusal for an
    answer. Redis that cannot persist refuses ``PING`` with its writes, and kombu pings every
    channel it opens: a worker started meanwhile looped on "Cannot connect ... MISCONF" and
    never got ready, though Redis answered and served reads. (kombu's client with a
    ``global_keyprefix`` is a ``functools.partial``: it stays as it is.)"""
    if not isinstance(base, type):
        return base

    class AnsweringRedis(base):
        def ping(self, **kwargs: Any) -> Any:
            try:
                return super().ping(**kwargs)
            except RedisResponseError as exc:
                if refusals.reason_of(exc) != "MISCONF":
                    raise
                REFUSALS.refused("connect", "MISCONF", exc)
                return True

    return AnsweringRedis


TAKE_MANY = resources.files("workers.consumer").joinpath("take_many.lua").read_text("utf-8")


"""The take script (``take_many.lua``: its KEYS, ARGV, reply and the keys it touches in its
header), read once at import; ``register_script`` names it by its SHA-1."""


class TakeRefused(Exception):
    """Redis refused the take script (nothing was taken).

    Args:
        reason: the refusal (``workers.batching.refusals.REASONS``: the take writes, so Redis
            refusing writes refuses it), or ``None`` for any other error reply.
    """

    def __init__(self, reason: str | None = None) -> None:
        super().__init__(reason or "refused")
        self.reason = reason
