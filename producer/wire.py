"""The bytes a request is on Redis, built without kombu's publish path.

A fleet request on Redis is one kombu message (JSON) in one list, the one kombu's Redis
transport would ``LPUSH`` for ``app.send_task``: ``<queue>`` for Celery priority 0, else
``<queue>\\x06\\x16<priority>`` (``shared.keys.priority_list_key``)::

    {"body": base64(JSON [args, kwargs, embed]),
     "content-encoding": "utf-8", "content-type": "application/json",
     "headers": {Celery protocol 2 headers: "task", "id", "lang", ...},
     "properties": {"correlation_id", "reply_to", "delivery_mode": 2,
                    "delivery_info": {"exchange": "", "routing_key": <queue>},
                    "priority": <0..9>, "body_encoding": "base64", "delivery_tag": <uuid4>}}

``properties`` comes last: the workers' take script reads the delivery tag from the payload's
tail (``workers.broker``). The headers and the message around the body are Celery's own
(``app.amqp.create_task_message``, serialized by kombu once per template), so nothing here
re-implements the task protocol; the body's JSON is compact (orjson), equal in value to
kombu's (every JSON reader, Celery's included, reads both alike).

:class:`PayloadBuilder` makes these bytes from per-(modality, priority) templates: Celery's
message is built once per template, not once per request; it also makes each request's
``task-sent`` event, sent per chunk as one group (:meth:`PayloadBuilder.sent_group`).
``FleetClient.submit_many`` sends both in pipelined transactions
(``producer.client_publish``); the gateway pushes the message alone.

Why: kombu's publish is synchronous (a thread per in-flight publish for an asyncio caller),
costs a second round trip for the ``task-sent`` event, and a few hundred microseconds of
Python per message; the gateway pushes these bytes with ``redis.asyncio`` in the same round
trip as its other commands, and sends no ``task-sent`` event (Flower shows its requests from
the worker's ``task-received``).
"""

from __future__ import annotations

import base64
import json
import math
import os
import random
import re
import time
from typing import Any

import orjson
from celery import Celery
from celery.utils.nodenames import anon_nodename
from celery.utils.time import utcoffset
from kombu.utils.json import dumps

from shared import jsonfast, keys, tracing
from shared.queue_stats import fleet_headers
from shared.schema import ENVELOPE_KWARG, TaskEnvelope


def kwargs_summary(env: TaskEnvelope) -> str:
    """A short ``kwargsrepr`` for a request (Flower's "kwargs" column): modality, priority,
    model and the input keys, never the inputs themselves."""
    inputs = ", ".join(sorted(env.inputs))
    return (
        f"{{'request': {{'modality': {env.modality!r}, 'priority': {env.priority!r}, "
        f"'model': {env.model!r}, 'inputs': <{inputs}>}}}}"
    )


class _Template:
    """A JSON text with markers (``"@@name@@"`` strings; ``, "@@extra@@": 0`` for extra
    members of the object it closes), split into its constant pieces and the markers'
    names (a join of pieces and values is several times faster than ``str.format``)."""

    _SLOT = re.compile(r'"@@(\w+)@@"|, "@@extra@@": 0')

    def __init__(self, text: str) -> None:
        self.pieces: list[str] = []  # the constant text before each marker, then the tail
        self.names: list[str] = []
        at = 0
        for match in self._SLOT.finditer(text):
            self.pieces.append(text[at : match.start()])
            self.names.append(match.group(1) or "extra")
            at = match.end()
        self.pieces.append(text[at:])

    def fill(self, values: dict[str, str]) -> bytes:
        """The text with each marker replaced by ``values[name]`` (JSON text)."""
        out = []
        for piece, name in zip(self.pieces, self.names, strict=False):
            out.append(piece)
            out.append(values[name])
        out.append(self.pieces[-1])
        return "".join(out).encode()


_EXTRA = "@@extra@@"
_SAMPLE = TaskEnvelope(modality="text", priority="normal", inputs={})  # fleet_headers' names


class PayloadBuilder:
    """Builds the messages of many requests of one producer, and their ``task-sent`` events.

    Celery's ``create_task_message`` runs once per (process, modality, queue, priority): the
    whole message with markers in place of a request's values (ids, kwargs summary, submit
    time, body, delivery tag, trace headers) is serialized once by kombu, and a request's
    bytes are the constant pieces joined with its values' JSON: the message kombu's publish
    would push, equal in value (the body's JSON compact), the delivery tag a fresh uuid4.

    Thread safety: templates are only added (a race builds one twice, equal); any thread may
    call :meth:`payload` and :meth:`build`.
    """

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._templates: dict[tuple[Any, ...], tuple[_Template, bytes]] = {}
        self._events: dict[tuple[Any, ...], _Template] = {}
        self._groups: dict[int, _Template] = {}
        self._utc = ("", -math.inf)  # (utcoffset as JSON, when read: monotonic s)

    def _template(
        self, modality: str, queue: str, prio: int, reply_to: str
    ) -> tuple[_Template, bytes]:
        """(the message's template, the body's JSON after the kwargs) of this kind of request."""
        key = (os.getpid(), modality, queue, prio, reply_to)  # "origin" names the process
        found = self._templates.get(key)
        if found is not None:
            return found
        m = self.app.amqp.create_task_message(
            "@@id@@", keys.task_name(modality), (), {}, reply_to=reply_to, argsrepr="()"
        )
        fleet = {k: f"@@{k}@@" for k in fleet_headers(_SAMPLE)}
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
        self._templates[key] = found = (_Template(dumps(message)), dumps(m.body[2]).encode())
        return found

    def payload(
        self, env: TaskEnvelope, task_id: str, queue: str, celery_priority: int, reply_to: str
    ) -> tuple[str, bytes]:
        """The Redis list and the message of one request: ``LPUSH list_key payload``
        enqueues it.

        Args:
            env: the validated request (``FleetClient.envelope``); travels as the task's
                kwargs. task_id: the task id; queue: a queue name from :mod:`shared.keys`;
            celery_priority: 0 (first) .. 9; reply_to: the producer's reply address (any
                string; the fleet does not reply through it).

        Raises:
            TypeError, ValueError: ``env.inputs`` is not JSON (see :func:`envelope_json`).
        """
        key, payload, _ = self.build(env, task_id, queue, celery_priority, reply_to)
        return key, payload

    def build(
        self,
        env: TaskEnvelope,
        task_id: str,
        queue: str,
        celery_priority: int,
        reply_to: str,
        sent_event: bool = False,
    ) -> tuple[str, bytes, bytes | None]:
        """:meth:`payload`'s ``(list_key, payload)``, and with ``sent_event`` the request's
        ``task-sent`` event as Celery's publish makes it (its fields; ``kwargs`` the same
        summary as the message's ``kwargsrepr``), as JSON, to be sent in a group
        (:meth:`sent_group`); else ``None``."""
        template, embed = self._template(env.modality, queue, celery_priority, reply_to)
        extra: dict[str, Any] = {}
        tracing.inject(extra, env.modality, task_id)
        tid, summary = _string(task_id), _string(kwargs_summary(env))
        values = {
            "id": tid,
            "kwargsrepr": summary,
            **{k: _json(v) for k, v in fleet_headers(env).items()},
            "body": _b64(b"[[],{" + _REQUEST + envelope_json(env) + b"}," + embed + b"]"),
            "tag": _tag(),
            "extra": ", " + json.dumps(extra)[1:-1] if extra else "",
        }
        key = keys.priority_list_key(queue, celery_priority)
        if not sent_event:
            return key, template.fill(values), None
        return key, template.fill(values), self._sent_event(env.modality, queue, tid, summary)

    def _sent_event(self, modality: str, queue: str, tid: str, summary: str) -> bytes:
        """The event of :meth:`build` (its JSON); ``tid`` and ``summary`` as JSON strings."""
        key = (os.getpid(), modality, queue)  # the event names the process
        template = self._events.get(key)
        if template is None:
            template = self._events[key] = self._event_template(modality, queue)
        return template.fill(
            {
                "id": tid,
                "kwargs": summary,
                "utcoffset": self._utcoffset(),
                "clock": str(self.app.clock.forward()),
                "timestamp": _json(time.time()),
            }
        )

    def sent_group(self, events: list[bytes]) -> bytes:
        """The message that carries ``events`` (from :meth:`build`) as one group, as Celery's
        ``EventDispatcher.flush`` sends a group: its body the list of events. Every Celery
        event receiver (Flower's, ``fleet exporter``'s) takes a list body event by event.
        Published on the event exchange's ``task.sent`` topic (the one a single event
        would go to), so a receiver bound to ``task.sent`` gets it."""
        key = os.getpid()  # the message names the host of the process
        message = self._groups.get(key)
        if message is None:
            message = self._groups[key] = self._group_template()
        return message.fill({"body": _b64(b"[" + b",".join(events) + b"]"), "tag": _tag()})

    def _utcoffset(self) -> str:
        """Celery's ``utcoffset()`` (hours) as JSON, read again after a minute (DST)."""
        now = time.monotonic()
        if now - self._utc[1] > 60.0:
            self._utc = (_json(utcoffset()), now)
        return self._utc[0]

    def _event_template(self, modality: str, queue: str) -> _Template:
        """The template of one ``task-sent`` event (a group's list item)."""
        event = {
            "hostname": anon_nodename(),
            "utcoffset": "@@utcoffset@@",
            "pid": os.getpid(),
            "clock": "@@clock@@",
            "uuid": "@@id@@",
            "root_id": "@@id@@",
            "parent_id": None,
            "name": keys.task_name(modality),
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
        return _Template(dumps(event))

    def _group_template(self) -> _Template:
        """The template of the message of :meth:`sent_group`."""
        exchange = self.app.conf.event_exchange
        message = {
            "body": "@@body@@",
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {"hostname": anon_nodename()},
            "properties": {
                "delivery_mode": 1,
                "delivery_info": {"exchange": exchange, "routing_key": "task.sent"},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": "@@tag@@",
            },
        }
        return _Template(dumps(message))


def envelope_json(env: TaskEnvelope) -> bytes:
    """``env`` as the ``request`` kwarg's JSON (UTF-8), equal in value to
    ``env.model_dump(mode="json")``: its fields in order, the inputs last.

    Raises:
        TypeError, ValueError: the inputs are not JSON (``shared.jsonfast.compact``;
            ``FleetClient.envelope`` refuses such inputs before).
    """
    head = {name: getattr(env, name) for name in _HEAD_FIELDS}  # numbers, strings, None
    try:
        start = orjson.dumps(head)
    except TypeError:  # a subclass of a builtin: json decides
        start = jsonfast.compact(head)
    return start[:-1] + b',"inputs":' + jsonfast.compact(env.inputs) + b"}"


_HEAD_FIELDS = tuple(name for name in TaskEnvelope.model_fields if name != "inputs")
_REQUEST = b'"' + ENVELOPE_KWARG.encode() + b'":'


def _string(value: str) -> str:
    """A JSON string, as ``json.dumps`` writes it (ASCII, escaped)."""
    return json.encoder.encode_basestring_ascii(value)  # type: ignore[attr-defined]


def _json(value: Any) -> str:
    """``json.dumps(value)``; a finite float written directly (the same text)."""
    if type(value) is float and math.isfinite(value):
        return repr(value)
    return json.dumps(value)


def fresh_ids(n: int) -> list[str]:
    """``n`` random uuid4s as ``str(uuid.uuid4())`` writes them, from one ``os.urandom``
    read: task ids must be unguessable (the gateway reads and cancels a job by its id)."""
    raw = os.urandom(16 * n)
    out = []
    for i in range(0, 16 * n, 16):
        h = f"{int.from_bytes(raw[i : i + 16]) & _UUID_MASK | _UUID4_BITS:032x}"
        out.append(f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
    return out


def _tag() -> str:
    """A delivery tag: a random uuid4 as a JSON string (kombu's are ``str(uuid4())``),
    from ``random`` rather than ``os.urandom``: tags must be unique, not unpredictable
    (``random`` is reseeded in a forked child)."""
    h = f"{random.getrandbits(128) & _UUID_MASK | _UUID4_BITS:032x}"
    return f'"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"'


_UUID_MASK = ~((0xF000 << 64) | (0xC000 << 48)) & ((1 << 128) - 1)
_UUID4_BITS = (0x4000 << 64) | (0x8000 << 48)  # version 4, RFC 4122 variant


def _b64(raw: bytes) -> str:
    """``raw`` in base64, as a JSON string."""
    return '"' + base64.b64encode(raw).decode("ascii") + '"'
