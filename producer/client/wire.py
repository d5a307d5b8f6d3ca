"""The bytes a request is on Redis, built without kombu's publish path.

A fleet request on Redis is one kombu message (JSON) in one list, the one kombu's Redis
transport would ``LPUSH`` for ``app.send_task``: ``<queue>`` for Celery priority 0, else
``<queue>\x06\x16<priority>`` (``shared.schema.priority_list_key``)::

    {"body": base64(JSON [args, kwargs, embed]),
     "content-encoding": "utf-8", "content-type": "application/json",
     "headers": {Celery protocol 2 headers: "task", "id", "lang", ...},
     "properties": {"correlation_id", "reply_to", "delivery_mode": 2,
                    "delivery_info": {"exchange": "", "routing_key": <queue>},
                    "priority": <0..9>, "body_encoding": "base64", "delivery_tag": <uuid4>}}

``properties`` comes last: the workers' take script reads the delivery tag from the payload's
tail (``workers.consumer.channel``). The headers and the message around the body are Celery's own
(``app.amqp.create_task_message``, serialized by kombu once per template), so nothing here
re-implements the task protocol; the values filled in (ids, the body, the submit time) are
compact JSON (orjson), equal in value to kombu's (every JSON reader, Celery's included, reads
both alike).

:class:`PayloadBuilder` makes these bytes from per-(modality, queue, priority) templates:
Celery's message is built once per template, not once per request; it also makes each
request's ``task-sent`` event, sent per chunk as one group (:meth:`PayloadBuilder.sent_group`).
``FleetClient.submit_many`` sends both in pipelined transactions
(``producer.client.fleet``), ``AsyncFleetClient.submit_many`` the same commands
(:func:`push_commands`) on ``redis.asyncio``; the gateway pushes the message alone.

Why: kombu's publish is synchronous (a thread per in-flight publish for an asyncio caller),
costs a second round trip for the ``task-sent`` event, and a few hundred microseconds of
Python per message; ``submit_many`` is measured against the raw Redis pipeline
(``fleet bench submit-rate``), so a request's bytes cost a few microseconds here.

:class:`Pusher` is how ``FleetClient.publish_many`` puts chunks of messages on Redis
(``producer.client.fleet`` drives it): one Redis connection per call (:class:`Line`), each chunk one
``MULTI``/``EXEC`` transaction (:class:`Chunk`) sent before the next chunk is built and its replies
read after, and the queue-length check's ``LLEN``s (:class:`DepthCheck`) on the same connection,
asked before the first chunk is built and judged before it is sent.

Faults: an attempt that fails drops the connection (its replies may be left unread on it); the
next attempt (``Connection.ensure``'s retry, after kombu reconnected) takes a fresh one from the
channel's pool and sends the transaction again (:func:`attempt`). A chunk with requests of a
tenant with ``max_queued`` is first checked again under a ``WATCH`` on that connection (the
first one's died with its connection), and not sent again when its first ``EXEC`` was applied
(its reply lost; :meth:`Chunk.resend`, ``shared.tenant_quota.applied``).

Private kombu/Celery names (read from kombu 5.7.0; ``tests/unit/test_private_names.py``):
    kombu.transport.redis.Channel: _get_publish_topics (new in 5.7)
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import time
from binascii import b2a_base64
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson
import redis
from celery import Celery
from celery.utils.nodenames import anon_nodename
from celery.utils.time import utcoffset
from kombu.utils.json import dumps

from shared import schema, tenant_quota, tracing
from shared.errors import QueueFull, TenantQuota
from shared.ha import WaitingPut
from shared.queue_stats import FLEET_HEADER_FIELDS
from shared.redis_client import SentTransaction, send_transaction
from shared.schema import ENVELOPE_KWARG, TaskEnvelope
from shared.tenant_quota import Quota

if TYPE_CHECKING:
    from shared.settings import Settings


def kwargs_summary(env: TaskEnvelope) -> str:
    """A short ``kwargsrepr`` for a request (Flower's "kwargs" column): modality, priority,
    model, tenant and the input keys, never the inputs themselves."""
    inputs = ", ".join(sorted(env.inputs))
    return (
        f"{{'request': {{'modality': {env.modality!r}, 'priority': {env.priority!r}, "
        f"'model': {env.model!r}, 'tenant': {env.tenant!r}, 'inputs': <{inputs}>}}}}"
    )


class Outgoing(NamedTuple):
    """One request ready to push: its priority list, its message, its ``task-sent`` event's
    JSON (``None``: no event, ``task_send_sent_event`` off), and what its tenant's
    ``max_queued`` must admit (``shared.tenant_quota.Quota``; ``None``: no limit)."""

    key: str
    payload: bytes
    event: bytes | None
    quota: Quota | None = None


class _Format:
    """A JSON text with markers (``"@@name@@"`` strings; ``,"@@extra@@":0`` for extra
    members of the object it closes) as a bytes ``%``-format: :meth:`fill` takes the
    values (JSON, UTF-8) in ``order``, whatever order the text has them in, and is two C
    calls (an ``itemgetter`` and the ``%``).

    Raises:
        ValueError: the text has a marker that ``order`` does not name, or fewer than two.
    """

    _SLOT = re.compile(r'"@@(\w+)@@"|,\s*"@@extra@@":\s*0')

    def __init__(self, text: str, order: Sequence[str]) -> None:
        names = [m.group(1) or "extra" for m in self._SLOT.finditer(text)]
        self.fmt = self._SLOT.sub("%s", text.replace("%", "%%")).encode()
        if len(names) < 2:  # itemgetter of one index returns the item, not a tuple
            raise ValueError("a format has two markers or more")
        self.pick = itemgetter(*(list(order).index(n) for n in names))

    def fill(self, values: Sequence[bytes]) -> bytes:
        """The text with each marker replaced by its value (``values`` in ``order``)."""
        return self.fmt % self.pick(values)


class _Kind:
    """What every request of one (process, modality, queue, priority, reply address) shares:
    its list, its message's format and the body's trailing ``embed`` JSON."""

    __slots__ = ("embed", "list_key", "message")

    def __init__(self, list_key: str, message: _Format, embed: bytes) -> None:
        self.list_key = list_key
        self.message = message
        self.embed = embed


# the values a message's format is filled with, in this order (then the fleet headers', in
# FLEET_HEADER_FIELDS' order), and an event's
_MESSAGE_SLOTS = ("body", "id", "kwargsrepr", "extra", "tag")


_EVENT_SLOTS = ("id", "kwargs", "utcoffset", "clock", "timestamp")


_EXTRA = "@@extra@@"


_FLEET_FIELDS = tuple(FLEET_HEADER_FIELDS.values())  # in fleet_headers' order


# an envelope's fields -> its fleet headers' values (one value, or a tuple of two or more)
_fleet_values = itemgetter(*_FLEET_FIELDS)


_FLEET_ONE = len(_FLEET_FIELDS) == 1


_outgoing = tuple.__new__  # Outgoing(*t) without NamedTuple's Python-level __new__


_SUMMARY_CACHE_MAX = 1024  # summaries kept (per distinct input keys); more are built each time


class PayloadBuilder:
    """Builds the messages of many requests of one producer, and their ``task-sent`` events.

    Celery's ``create_task_message`` runs once per (process, modality, queue, priority): the
    whole message with markers in place of a request's values (ids, kwargs summary, submit
    time, body, delivery tag, trace headers) is serialized once by kombu (compact: no blank
    after ``,`` and ``:``), and a request's bytes are that text with its values' JSON filled
    in: the message kombu's publish would push, equal in value, the delivery tag a fresh
    uuid4.

    Thread safety: caches are only added to (a race builds an entry twice, equal); any thread
    may call :meth:`payload`, :meth:`build` and :meth:`sent_group`.
    """

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._kinds: dict[tuple[Any, ...], _Kind] = {}
        self._events: dict[tuple[Any, ...], _Format] = {}
        self._groups: dict[int, _Format] = {}
        self._summaries: dict[tuple[Any, ...], bytes] = {}
        self._tags: tuple[int, bytes, Iterator[int]] = (0, b"", itertools.count())
        self._utc = (b"", -math.inf)  # (utcoffset as JSON, when read: monotonic s)

    def _kind(self, modality: str, queue: str, prio: int, reply_to: str) -> _Kind:
        """The template of this kind of request (built on first use)."""
        key = (_pid, modality, queue, prio, reply_to)  # "origin" names the process
        found = self._kinds.get(key)
        if found is not None:
            return found
        m = self.app.amqp.create_task_message(
            "@@id@@", schema.task_name(modality), (), {}, reply_to=reply_to, argsrepr="()"
        )
        fleet = {k: f"@@{k}@@" for k in FLEET_HEADER_FIELDS}
        headers = {**m.headers, "kwargsrepr": "@@kwargsrepr@@", **fleet}
        headers[_EXTRA] = 0  # trace context, when there is one, goes last (as tracing.inject)
        message = {
            "body": "@@body@@",
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": headers,
            "properties": {
                **m.properties,
                "delivery_mode": 2,
                "delivery_info": {"exchange": "", "routing_key": queue},
                "priority": prio,
                "body_encoding": "base64",
                "delivery_tag": "@@tag@@",
            },
        }
        list_key = schema.priority_list_key(queue, prio)
        text = _Format(_compact(message), (*_MESSAGE_SLOTS, *FLEET_HEADER_FIELDS))
        found = _Kind(list_key, text, dumps(m.body[2]).encode())
        self._kinds[key] = found
        return found

    def payload(
        self, env: TaskEnvelope, task_id: str, queue: str, celery_priority: int, reply_to: str
    ) -> tuple[str, bytes]:
        """The Redis list and the message of one request: ``LPUSH list_key payload``
        enqueues it.

        Args:
            env: the validated request (``FleetClient.envelope``); travels as the task's
                kwargs. task_id: the task id; queue: a queue name from :mod:`shared.schema`;
            celery_priority: 0 (first) .. 9; reply_to: the producer's reply address (any
                string; the fleet does not reply through it).

        Raises:
            TypeError, ValueError: ``env.inputs`` is not JSON (see :func:`envelope_json`).
        """
        built = self.build(env, task_id, queue, celery_priority, reply_to)
        return built.key, built.payload

    def build(
        self,
        env: TaskEnvelope,
        task_id: str,
        queue: str,
        celery_priority: int,
        reply_to: str,
        sent_event: bool = False,
        inputs_json: bytes | None = None,
    ) -> Outgoing:
        """:meth:`payload`'s ``(list_key, payload)``, and with ``sent_event`` the request's
        ``task-sent`` event as Celery's publish makes it (its fields; ``kwargs`` the same
        summary as the message's ``kwargsrepr``), as JSON, to be sent in a group
        (:meth:`sent_group`); else ``None``. ``inputs_json``: ``env.inputs`` as
        :func:`shared.schema.compact` wrote it, when the caller has it (validation does)."""
        route = {(env.modality, env.priority, env.model): (queue, celery_priority)}
        return self.build_many([(env, task_id, inputs_json)], route, reply_to, sent_event)[0]

    def build_many(
        self,
        requests: Sequence[tuple[TaskEnvelope, str, bytes | None]],
        route: Mapping[tuple[str, str, str | None], tuple[str, int]],
        reply_to: str,
        sent_event: bool = False,
    ) -> list[Outgoing]:
        """:meth:`build` of many requests ``(env, task_id, inputs_json)``: one loop, the
        templates looked up once per kind. ``route``: (modality, priority label, model) ->
        (queue, Celery priority) for every triple among them.

        Raises:
            KeyError: a request's (modality, priority, model) is not in ``route``.
            TypeError, ValueError: inputs that are not JSON (see :func:`envelope_json`).
        """
        kinds: dict[tuple[str, str, str | None], tuple[_Kind, _Format | None]] = {}
        summaries = self._summaries
        tags = self._delivery_tags(len(requests))
        tracing_on = tracing.active()
        utc, stamp = self._utcoffset(), orjson.dumps(time.time())  # the events' time: now
        clock = itertools.count(_reserve(self.app.clock, len(requests)) if sent_event else 0)
        last: Any = None  # the fleet headers' values of the request before, and their JSON
        fleet: tuple[bytes, ...] = ()
        out: list[Outgoing] = []
        for (env, task_id, data), tag in zip(requests, tags, strict=True):
            d = env.__dict__  # pydantic's field values, in field order
            pair = (d["modality"], d["priority"], d["model"])
            found = kinds.get(pair)
            if found is None:
                queue, prio = route[pair]
                event = self._event_format(pair[0], queue) if sent_event else None
                found = kinds[pair] = (self._kind(pair[0], queue, prio, reply_to), event)
            kind, event = found
            tid = orjson.dumps(task_id)
            summary = summaries.get((*pair, d["tenant"], *d["inputs"])) or self._summary(env)
            message = kind.message
            if (fv := _fleet_values(d)) != last:  # one submit time for a call's requests
                last, fleet = fv, ((_json(fv),) if _FLEET_ONE else tuple(map(_json, fv)))
            values = (
                _body(env, data, kind.embed),
                tid,
                summary,
                _trace(env, task_id) if tracing_on else b"",
                tag,
                *fleet,
            )
            payload = message.fmt % message.pick(values)
            if event is None:
                out.append(_outgoing(Outgoing, (kind.list_key, payload, None, None)))
                continue
            sent = (tid, summary, utc, b"%d" % next(clock), stamp)
            built = (kind.list_key, payload, event.fmt % event.pick(sent), None)
            out.append(_outgoing(Outgoing, built))
        return out

    def _summary(self, env: TaskEnvelope) -> bytes:
        """:func:`kwargs_summary` as JSON, cached per modality, priority, model, tenant and
        input keys (a few kinds per producer; bounded)."""
        key = (env.modality, env.priority, env.model, env.tenant, *env.inputs)
        found = self._summaries.get(key)
        if found is None:
            found = orjson.dumps(kwargs_summary(env))
            if len(self._summaries) < _SUMMARY_CACHE_MAX:
                self._summaries[key] = found
        return found

    def _delivery_tags(self, n: int) -> list[bytes]:
        """``n`` delivery tags as JSON strings: uuid4-shaped (kombu's are ``str(uuid4())``),
        a random prefix per builder and process and a counter in the last group. Tags must
        be unique (the unacked hash is keyed by them), not unpredictable; a forked child
        draws a prefix of its own."""
        pid, prefix, counter = self._tags
        if pid != _pid:
            prefix = _uuid4s(os.urandom(16))[0][:24].encode()
            counter = itertools.count()
            self._tags = (_pid, prefix, counter)
        return [b'"%s%012x"' % (prefix, next(counter) & _LOW48) for _ in range(n)]

    def _event_format(self, modality: str, queue: str) -> _Format:
        """The template of a ``task-sent`` event of ``modality`` on ``queue``."""
        key = (_pid, modality, queue)  # the event names the process
        template = self._events.get(key)
        if template is None:
            template = self._events[key] = self._event_template(modality, queue)
        return template

    def sent_group(self, events: list[bytes]) -> bytes:
        """The message that carries ``events`` (from :meth:`build`) as one group, as Celery's
        ``EventDispatcher.flush`` sends a group: its body the list of events. Every Celery
        event receiver (Flower's, ``fleet exporter``'s) takes a list body event by event.
        Published on the event exchange's ``task.sent`` topic (the one a single event
        would go to), so a receiver bound to ``task.sent`` gets it.

        The body is the events' JSON list itself, in the message's JSON, with content type
        ``application/data`` (encoding ``binary``, no ``body_encoding``): kombu's virtual
        transport hands such a body on as it was read, the list, which every receiver takes
        (``application/data`` is among kombu's trusted types). Celery's own group is
        ``application/json`` in base64: a third more bytes, a base64 and a second JSON
        decode per group in every receiver; the events are the same."""
        key = _pid  # the message names the host of the process
        message = self._groups.get(key)
        if message is None:
            message = self._groups[key] = self._group_template()
        body = b"[" + b",".join(events) + b"]"
        return message.fill((body, self._delivery_tags(1)[0]))

    def _utcoffset(self) -> bytes:
        """Celery's ``utcoffset()`` (hours) as JSON, read again after a minute (DST)."""
        now = time.monotonic()
        if now - self._utc[1] > 60.0:
            self._utc = (_json(utcoffset()), now)
        return self._utc[0]

    def _event_template(self, modality: str, queue: str) -> _Format:
        """The template of one ``task-sent`` event (a group's list item)."""
        event = {
            "hostname": anon_nodename(),
            "utcoffset": "@@utcoffset@@",
            "pid": os.getpid(),
            "clock": "@@clock@@",
            "uuid": "@@id@@",
            "root_id": "@@id@@",
            "parent_id": None,
            "name": schema.task_name(modality),
            "args": "()",
            "kwargs": "@@kwargs@@",
            "retries": 0,
            "eta": None,
            "expires": None,
            "queue": queue,
            "exchange": "",
            "routing_key": queue,
            "timestamp": "@@timestamp@@",
            "type": "task-sent",
        }
        return _Format(_compact(event), _EVENT_SLOTS)

    def _group_template(self) -> _Format:
        """The template of the message of :meth:`sent_group`."""
        exchange = self.app.conf.event_exchange
        message = {
            "body": "@@body@@",
            "content-encoding": "binary",
            "content-type": "application/data",
            "headers": {"hostname": anon_nodename()},
            "properties": {
                "delivery_mode": 1,
                "delivery_info": {"exchange": exchange, "routing_key": "task.sent"},
                "priority": 0,
                "delivery_tag": "@@tag@@",
            },
        }
        return _Format(_compact(message), ("body", "tag"))


_LOW48 = (1 << 48) - 1


_pid = os.getpid()  # this process's: the templates name it ("origin", the events' "pid")


def _after_fork() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork)


def _compact(value: Any) -> str:
    """``value`` as kombu's JSON writes it, without the blanks after ``,`` and ``:``."""
    return dumps(value, separators=(",", ":"))


def _reserve(clock: Any, n: int) -> int:
    """The first of ``n`` consecutive values of kombu's ``LamportClock`` ``clock``, as ``n``
    ``forward()`` calls would give them (one lock, not ``n``)."""
    with clock.mutex:
        first = clock.value + 1
        clock.value += n
    return first


def _body(env: TaskEnvelope, inputs_json: bytes | None, embed: bytes) -> bytes:
    """The message body of ``env`` (base64 of the JSON ``[[], {"request": env}, embed]``)
    as a JSON string."""
    if inputs_json is None:
        envelope = envelope_json(env)
    else:  # the inputs passed compact: finite, of orjson's types, or json's
        try:
            envelope = orjson.dumps(env.__dict__, default=schema.refuse, option=schema.OPTIONS)
        except TypeError:  # a subclass of a builtin, or a type only json writes
            envelope = envelope_json(env, inputs_json)
    raw = b'[[],{"' + _KWARG + b'":' + envelope + b"}," + embed + b"]"
    return b'"' + b2a_base64(raw, newline=False) + b'"'


def _trace(env: TaskEnvelope, task_id: str) -> bytes:
    """The ``extra`` slot: a ``fleet.submit`` span's context headers (``tracing.inject``),
    as JSON members after the others; empty when none."""
    extra: dict[str, Any] = {}
    tracing.inject(extra, env.modality, task_id)
    return b"," + _compact(extra)[1:-1].encode() if extra else b""


def envelope_json(env: TaskEnvelope, inputs_json: bytes | None = None) -> bytes:
    """``env`` as the ``request`` kwarg's JSON (UTF-8), equal in value to
    ``env.model_dump(mode="json")``: its fields in order, the inputs last (``inputs_json``
    when given: ``env.inputs`` as :func:`shared.schema.compact` writes it).

    Raises:
        TypeError, ValueError: the inputs are not JSON (``shared.schema.compact``;
            ``FleetClient.envelope`` refuses such inputs before).
    """
    head = {name: getattr(env, name) for name in _HEAD_FIELDS}  # numbers, strings, None
    try:
        start = orjson.dumps(head)
    except TypeError:  # a subclass of a builtin: json decides
        start = schema.compact(head)
    if inputs_json is None:
        inputs_json = schema.compact(env.inputs)
    return start[:-1] + b',"inputs":' + inputs_json + b"}"


_HEAD_FIELDS = tuple(name for name in TaskEnvelope.model_fields if name != "inputs")


_KWARG = ENVELOPE_KWARG.encode()


def _json(value: Any) -> bytes:
    """``value`` as JSON (UTF-8): orjson's, but a non-finite float as ``json.dumps``
    writes it (``NaN``, ``Infinity``: orjson would write ``null``)."""
    if type(value) is float and not math.isfinite(value):
        return json.dumps(value).encode()
    return orjson.dumps(value)


def fresh_ids(n: int) -> list[str]:
    """``n`` random uuid4s as ``str(uuid.uuid4())`` writes them, from one ``os.urandom``
    read: task ids must be unguessable (the gateway reads and cancels a job by its id)."""
    return _uuid4s(os.urandom(16 * n))


def _uuid4s(raw: bytes) -> list[str]:
    """The uuid4s made of ``raw``'s 16-byte pieces: its bits, but the version nibble (4)
    and the RFC 4122 variant's two bits, as ``uuid.UUID(bytes=..., version=4)`` sets them."""
    h = raw.hex()
    return [
        f"{h[i : i + 8]}-{h[i + 8 : i + 12]}-4{h[i + 13 : i + 16]}-"
        f"{_VARIANT[h[i + 16]]}{h[i + 17 : i + 20]}-{h[i + 20 : i + 32]}"
        for i in range(0, len(h) - 31, 32)
    ]


_VARIANT = {c: "89ab"[int(c, 16) & 3] for c in "0123456789abcdef"}  # 10xx: RFC 4122


def push_commands(
    part: Sequence[Outgoing], group: bytes | None, topics: Sequence[str]
) -> list[tuple[Any, ...]]:
    """The commands that put ``part`` on Redis, for one ``MULTI``/``EXEC`` (both clients
    send these): an ``LPUSH`` per list (its messages in order: ``LPUSH k a b`` is ``LPUSH k
    a; LPUSH k b``), then a ``PUBLISH`` of ``group`` (the part's ``task-sent`` events,
    :meth:`PayloadBuilder.sent_group`; ``None``: none) on each of ``topics``. A part with
    requests of a tenant with ``max_queued`` first adds their ids to its tenant's set
    (``shared.tenant_quota``; the sender checked the limit under ``WATCH`` before)."""
    commands: list[tuple[Any, ...]] = []
    if any(m.quota is not None for m in part):  # a tenant's max_queued: its open requests
        commands = tenant_quota.add_commands(part)
    lists: dict[str, list[bytes]] = {}
    for m in part:
        lists.setdefault(m.key, []).append(m.payload)
    commands += [("LPUSH", k, *v) for k, v in lists.items()]
    if group is not None:
        commands += [("PUBLISH", t, group) for t in topics]
    return commands


def sent_topics(app: Celery, db: int) -> list[str]:
    """The channels a ``task-sent`` group is published on, for a client that has no kombu
    channel to ask (``AsyncFleetClient``): kombu's Redis fanout topic of the event exchange's
    ``task.sent`` routing key as its channel makes it (``fanout_prefix``: ``/<db>.`` or a
    string of the transport options, formatted with ``db``; ``fanout_patterns``: ``/<routing
    key>``; both on unless ``broker_transport_options`` turn them off; ``shared.acl`` grants
    the producer ``/<db>.celeryev/*``).
    ``tests/integration/test_async_client.py`` holds it to kombu's own answer."""
    options = app.conf.broker_transport_options or {}
    prefix = options.get("fanout_prefix", True)
    prefix = prefix if isinstance(prefix, str) else "/{db}." if prefix else ""
    topic = f"{prefix.format(db=db)}{app.conf.event_exchange}"
    return [f"{topic}/task.sent" if options.get("fanout_patterns", True) else topic]


class Nothing:
    """What kombu's ``Connection.ensure`` revives after a reconnect: nothing (each attempt
    takes the connection's channel afresh)."""

    def revive(self, channel: Any) -> None:
        """Called with the new channel after a reconnect; nothing to do."""


class Line:
    """One ``publish_many`` call's Redis connection: taken from the kombu connection's
    channel's client pool when first needed, kept for the call (one pool checkout, not one
    per transaction), dropped after a fault, given back by :meth:`close`."""

    def __init__(self, kconn: Any) -> None:
        self.kconn = kconn
        self.client: Any = None
        self.conn: Any = None

    def send(self, commands: Sequence[tuple[Any, ...]], atomic: bool = True) -> SentTransaction:
        """Send ``commands`` as one transaction (``atomic=False``: a plain pipeline;
        ``WAIT`` after it when the channel waits for a replica: ``shared.ha.WaitingPut``);
        read its replies before the next send's.

        Raises:
            redis.ConnectionError, redis.TimeoutError: the send failed.
        """
        channel = self.kconn.default_channel
        client = channel.client  # the channel's cached client: kombu's would be one per call
        if self.conn is None or client is not self.client:
            self.close()
            self.client, self.conn = client, client.connection_pool.get_connection()
        waiter = None
        if atomic and isinstance(channel, WaitingPut):  # writes: confirmed by a replica
            waiter = channel._put_waiter()
        return send_transaction(client, commands, waiter, self.conn, atomic)

    def channel(self) -> Any:
        """The kombu connection's channel (for its publish topics)."""
        return self.kconn.default_channel

    def drop(self) -> None:
        """After a fault: disconnect (replies may be left on it) and give it back."""
        if self.conn is not None:
            self.conn.disconnect()
        self.close()

    def close(self) -> None:
        """Give the connection back to its pool (its replies all read)."""
        conn, self.conn = self.conn, None
        if conn is not None:
            self.client.connection_pool.release(conn)


class Chunk:
    """One transaction of ``publish_many``: a chunk's pushes and its events' group message,
    or the queue-length check's ``LLEN``s (``commands`` given: read-only, sent as a plain
    pipeline), and the transaction once
    sent (or why the send failed) until its replies are read (:func:`attempt`)."""

    def __init__(
        self,
        part: list[Outgoing],
        group: bytes | None,
        exchange: str,
        commands: list[tuple[Any, ...]] | None = None,
        sets: tenant_quota.Sets | None = None,
        fresh: Sequence[str] = (),
    ) -> None:
        self.part, self.group, self.exchange = part, group, exchange
        self._commands = commands
        self.writes = commands is None  # pushes: a transaction; else reads: a pipeline
        self.sent: SentTransaction | BaseException | None = None
        # pushes of limited tenants' requests (their sets, the ids the first check found in
        # none): a retry checks again under a fresh WATCH (:meth:`resend`)
        self.sets, self.fresh = sets, fresh

    def commands(self, channel: Any) -> list[tuple[Any, ...]]:
        """:func:`push_commands` of the chunk (the group on the event exchange's
        ``task.sent`` topics, as kombu's ``channel`` names them)."""
        if self._commands is not None:
            return self._commands
        topics = []
        if self.group is not None:
            topics = channel._get_publish_topics(self.exchange, "task.sent")
        return push_commands(self.part, self.group, topics)

    def send(self, line: Line) -> None:
        """The first attempt's send; a failure is kept for :func:`attempt` to raise (where
        ``Connection.ensure`` retries it)."""
        try:
            self.sent = line.send(self.commands(line.channel()), self.writes)
        except Exception as exc:
            self.sent = exc

    def resend(self, line: Line) -> SentTransaction | None:
        """A retry's send, on ``line``'s (new) connection. Pushes of limited tenants'
        requests are checked again first, under a fresh ``WATCH`` (the first attempt's died
        with its connection): ``None`` when the first attempt's ``EXEC`` was applied (its
        reply lost: sent again, the chunk would be queued twice), else sent only if every
        tenant's ``max_queued`` still admits it (``shared.tenant_quota``).

        Raises:
            TenantQuota: a tenant's limit would be passed now; nothing sent.
        """
        if self.sets:
            commands = tenant_quota.recheck_commands(self.sets, self.fresh)
            replies = line.send(commands, atomic=False).replies()
            done = tenant_quota.applied(self.sets, self.fresh, replies)
            if not done:
                tenant_quota.judge(self.sets, replies)  # TenantQuota: the line is dropped
            if done:
                line.send([("UNWATCH",)], atomic=False).replies()
                return None
        return line.send(self.commands(line.channel()), self.writes)

    def abandon(self, line: Line) -> None:
        """Its replies will not be read: the connection is dropped."""
        if isinstance(self.sent, SentTransaction):
            line.drop()
        self.sent = None


def attempt(kconn: Any, line: Line, job: Chunk) -> list[Any]:
    """One attempt at ``job`` (``Connection.ensure`` retries it; ``kconn`` is its kombu
    connection): the replies of the transaction :meth:`Chunk.send` sent (the first
    attempt), or of the transaction sent again now (a retry).

    Raises:
        what the send or the replies raised (the connection dropped).
    """
    sent, job.sent = job.sent, None
    try:
        if isinstance(sent, BaseException):
            raise sent
        if sent is None:
            sent = job.resend(line)
            if sent is None:  # applied by the attempt whose reply was lost
                return []
        return sent.replies()
    except BaseException:
        line.drop()
        raise


class Pusher:
    """The chunks of one ``publish_many`` call on kombu connection ``kconn``: one
    :class:`Line`, each attempt through ``Connection.ensure`` with the publish retry
    ``policy``; ``group`` makes a chunk's events' message (``PayloadBuilder.sent_group``),
    published on the event ``exchange``."""

    def __init__(
        self,
        kconn: Any,
        policy: dict[str, Any],
        exchange: str,
        group: Callable[[list[bytes]], bytes],
    ) -> None:
        self.kconn, self.exchange, self.group = kconn, exchange, group
        self.line = Line(kconn)
        self.push: Attempt = kconn.ensure(Nothing(), attempt, **policy)
        self.inflight: Chunk | None = None  # sent, its replies not read yet

    def chunks(
        self, messages: Iterator[Outgoing], chunk: int, check: DepthCheck | None
    ) -> Iterator[int]:
        """Send ``messages`` in chunks of ``chunk``, each built while Redis takes the one
        before; yields after each chunk how many are on Redis. ``check`` is asked before
        the first chunk is built and judged before it is sent (``QueueFull``: nothing sent).
        A chunk sent before the next one fails to build is counted, then the error raised.
        """
        sent = 0
        if check is not None:  # asked now, answered while the first chunk is built
            self.inflight = Chunk([], None, self.exchange, check.commands())
            self.inflight.send(self.line)
        part = list(itertools.islice(messages, chunk))
        if check is not None:
            check.judge(self._finish())
        while part:
            events = [m.event for m in part if m.event is not None]
            group = self.group(events) if events else None
            sets = tenant_quota.sets_of(part) if any(m.quota for m in part) else None
            self._send(part, group, sets)
            failed = None
            try:  # the next chunk is built while Redis takes this one
                following = list(itertools.islice(messages, chunk))
            except Exception as exc:  # this chunk is sent: it is counted first
                following, failed = [], exc
            for tries in itertools.count(1):
                try:
                    self._finish()
                    break
                except redis.WatchError:  # a limited tenant's set changed: checked again
                    if sets is None or tries >= tenant_quota.WATCH_TRIES:
                        raise
                    self._send(part, group, sets)
            sent += len(part)
            yield sent
            if failed is not None:
                raise failed
            part = following

    def _send(self, part: list[Outgoing], group: bytes | None, sets: Any) -> None:
        """Send a chunk; one with requests of limited tenants (``sets``:
        ``shared.tenant_quota.sets_of``) only once their limits, read under ``WATCH`` on the
        same connection, allow it.

        Raises:
            TenantQuota: a tenant's limit would be passed; nothing of the chunk was sent.
        """
        fresh: list[str] = []
        if sets:
            check = Chunk([], None, self.exchange, tenant_quota.check_commands(sets))
            check.send(self.line)
            self.inflight = check
            replies = self._finish()
            try:
                tenant_quota.judge(sets, replies)
            except TenantQuota:
                self.line.send([("UNWATCH",)], atomic=False).replies()
                raise
            fresh = tenant_quota.absent(sets, replies)
        self.inflight = Chunk(part, group, self.exchange, sets=sets or None, fresh=fresh)
        self.inflight.send(self.line)

    def _finish(self) -> list[Any]:
        """The in-flight transaction's replies (retried per the policy)."""
        job, self.inflight = self.inflight, None
        assert job is not None
        return self.push(self.kconn, self.line, job)

    def close(self) -> None:
        """Give the connection back (dropped when a transaction's replies are unread)."""
        if self.inflight is not None:
            self.inflight.abandon(self.line)
            self.inflight = None
        self.line.close()


@dataclass(frozen=True)
class DepthCheck:
    """The queue-length limits (``max_queue_length``, ``max_queue_length_by_priority``)
    against one submission: ``rows`` (modality, class label, priority list, model of the
    queue) are asked with ``LLEN`` (:meth:`commands`) and their answers judged
    (:meth:`judge`), each model's queue on its own; ``models``: each envelope's queue model
    (``None``: the modality's own queue)."""

    settings: Settings
    envs: Sequence[TaskEnvelope]
    rows: list[tuple[str, str, str, str | None]]
    models: Sequence[str | None] | None = None

    def commands(self) -> list[tuple[Any, ...]]:
        """One ``LLEN`` per row."""
        return [("LLEN", row[2]) for row in self.rows]

    def judge(self, counts: Sequence[Any]) -> None:
        """Raises ``QueueFull`` when the submission does not fit (``counts``: the
        ``LLEN`` answers, in ``rows``' order)."""
        depth: dict[tuple[str, str | None], dict[str, int]] = {}
        for (modality, label, _, model), n in zip(self.rows, counts, strict=True):
            by_class = depth.setdefault((modality, model), {})  # a class's lists: summed
            by_class[label] = by_class.get(label, 0) + int(n)
        models = self.models if self.models is not None else [None] * len(self.envs)
        for (modality, model), by_class in depth.items():
            envs = [e for e, m in zip(self.envs, models, strict=True) if m == model]
            judge(self.settings, modality, by_class, envs)


def judge(
    settings: Settings, modality: str, depth: dict[str, int], envs: Sequence[TaskEnvelope]
) -> None:
    """Whether ``envs`` fit ``modality``'s queue of ``depth`` (waiting per class).

    Raises:
        QueueFull: its total, or one priority's, limit would be exceeded.
    """
    cfg = settings.modalities[modality]
    adding = [e for e in envs if e.modality == modality]
    total = sum(depth.values())
    if cfg.max_queue_length and total + len(adding) > cfg.max_queue_length:
        raise QueueFull(
            f"{modality} queue holds {total} requests; the limit is {cfg.max_queue_length}"
        )
    for prio, limit in cfg.max_queue_length_by_priority.items():
        n = sum(e.priority == prio for e in adding)
        if n and depth.get(prio, 0) + n > limit:
            raise QueueFull(
                f"{modality}/{prio} queue holds {depth.get(prio, 0)} requests; the limit is {limit}"
            )


Attempt = Callable[[Any, Line, Chunk], list[Any]]  # attempt, as Connection.ensure wraps it
