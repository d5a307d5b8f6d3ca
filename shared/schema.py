"""The fleet's schema on Redis: every Celery name and Redis key the product uses, what a request
carries there (the task envelope and its priority class), and the JSON documents are written in.

The task envelope is what one inference request carries on the broker.
Each request is one Celery task (protocol 2, JSON body) named ``fleet.<modality>`` on the
queue of that modality, with a single keyword argument ``request`` holding the envelope::

    {"v": 1, "modality": "text", "priority": "realtime",
     "submitted_ms": 1764460800123.4, "deadline_ms": 1764460800323.4,
     "model": null, "tenant": null, "inputs": {"text": "A man is playing a guitar."}}

Times are Unix epoch milliseconds on Redis' clock (``TIME``, ``shared.clock``), the one
clock producers and workers on different hosts share: a host whose own clock is off neither
fails nor keeps requests past their deadline. ``deadline_ms`` null means no deadline.
Inputs per modality:

- text: ``{"text": str}``
- image: ``{"image_b64": str}`` (base64 of JPEG/PNG/WebP/... file bytes)
- video / xmodal: see their adapters.

Large tensors travel as ``TensorRef`` objects (see ``shared.transport``), never as bytes.


Priority classes (:class:`Priority`) map to Celery priorities and deadlines. Classes, highest
first: REALTIME, HIGH, NORMAL, BULK. Lower number runs first, as in
Celery's Redis transport (one list per priority step, 0 served first, FIFO inside a step).
The Celery priority and the default timeout of each class come from ``[priorities.*]`` in
``configs/fleet.toml``; a per-request ``timeout_s`` overrides the class default.


JSON (:func:`dumps`, :func:`loads`, :func:`compact`): result documents written fast, orjson
where it gives the document kombu's JSON would, and kombu's own codec where it might not. A
final result is Celery's result meta whose ``result`` usually holds float lists (an
embedding is 384 of them). kombu's ``json.dumps`` spends most of its time in Python's float
repr; orjson writes the same shortest round-trip repr of a Python float about twenty times
faster, so a batch's result write stops holding the worker's event loop (and the GIL) for
milliseconds, and a client decodes a result several times faster (the decision and its
figures: docs/decisions.md, "Result JSON").

Equal documents, not equal bytes: orjson writes no spaces after ``:`` and ``,``; every JSON
reader (Celery's ``AsyncResult``, Flower, other languages) parses both to the same values.
Where orjson's rules differ from kombu's, kombu's codec is used:

- non-finite floats: kombu writes ``NaN``/``Infinity`` (what Python's json reads back),
  orjson would write ``null``: a document with one is encoded by kombu;
- types JSON has no form for (datetime, dataclass, subclasses of builtins, non-string keys,
  integers beyond 64 bits): kombu's encoder and its type tags decide, as before;
- reading: a document with kombu's type tags (``"__type__"``) or one orjson refuses
  (``NaN``) is read by kombu's ``loads``.


Names and keys: one queue per modality, named after it (``text``, ``image``, ``video``,
``xmodal``), and one for its REALTIME requests (``text.realtime``, ...); those are its default
model's. Each other model a modality serves has its own pair, ``text@bge-small`` and
``text@bge-small.realtime`` (``shared.model_routes``). Celery's Redis transport
stores each priority step of a queue in its own list: the step-0 list is the queue name itself, step
``p`` is ``f"{queue}{PRIORITY_SEP}{p}"``.
"""

from __future__ import annotations

import json
import math
from enum import IntEnum
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared import clock
from shared.errors import InvalidInput, InvalidPriority, UnsupportedModality
from shared.settings import MODALITIES, Settings

__all__ = [
    "BLAME_INDEX_KEY",
    "BLAME_PREFIX",
    "ENVELOPE_KWARG",
    "FINAL_KEY_PREFIX",
    "JOB_KEY_PREFIX",
    "LIVE_FORGET_S",
    "LIVE_PREFIX",
    "MODEL_QUEUE_SEP",
    "NOTIFY_PROBE_PREFIX",
    "OPTIONS",
    "PRIORITY_SEP",
    "PRIORITY_STEPS",
    "RESULT_KEY_PREFIX",
    "TASK_PREFIX",
    "UNACKED_INDEX_KEY",
    "UNACKED_KEY",
    "Priority",
    "TaskEnvelope",
    "blame_record_key",
    "compact",
    "decode_result",
    "dumps",
    "final_key",
    "has_nonfinite",
    "job_key",
    "live_key",
    "loads",
    "model_queue_name",
    "priority_list_key",
    "queue_for",
    "queue_name",
    "realtime_queue_name",
    "refuse",
    "result_key",
    "task_name",
]


ENVELOPE_KWARG = "request"


class TaskEnvelope(BaseModel):
    """One inference request (frozen). See the module docstring for the wire format."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    v: Literal[1] = 1
    modality: str
    priority: str
    submitted_ms: float = Field(default_factory=lambda: clock.now_s() * 1000.0)
    deadline_ms: float | None = None
    model: str | None = None
    tenant: str | None = None  # None: the default tenant (shared.tenants)
    inputs: dict[str, Any]

    def expired(self, now_ms: float | None = None) -> bool:
        """True when a deadline is set and ``now_ms`` (default: now, on this process's
        clock: Redis' in a worker, ``shared.clock``) is past it."""
        if self.deadline_ms is None:
            return False
        now = clock.now_s() * 1000.0 if now_ms is None else now_ms
        return now > self.deadline_ms

    def to_kwargs(self) -> dict[str, Any]:
        """The Celery ``kwargs`` of the task message."""
        return {ENVELOPE_KWARG: self.model_dump(mode="json")}

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> TaskEnvelope:
        """Parse a task's kwargs.

        Raises:
            InvalidInput: the envelope is missing or malformed.
            UnsupportedModality: the modality is not one the fleet serves.
        """
        raw = kwargs.get(ENVELOPE_KWARG) if isinstance(kwargs, dict) else None
        if not isinstance(raw, dict):
            raise InvalidInput(f"task kwargs must hold a {ENVELOPE_KWARG!r} object")
        try:
            env = cls.model_validate(raw)
        except ValidationError as exc:
            raise InvalidInput(f"malformed request envelope: {_short(exc)}") from None
        if env.modality not in MODALITIES:
            raise UnsupportedModality(f"unknown modality {env.modality!r}")
        return env


def _short(exc: ValidationError) -> str:
    errs = exc.errors()[:3]
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errs)


class Priority(IntEnum):
    """A request's priority class; the int value orders classes (0 = most urgent)."""

    REALTIME = 0
    HIGH = 1
    NORMAL = 2
    BULK = 3

    @property
    def label(self) -> str:
        """Lower-case name used in configs, messages and metrics (``"realtime"``)."""
        return _LABELS[self]

    @classmethod
    def parse(cls, value: str | int | Priority) -> Priority:
        """Accept a class name (any case) or an existing :class:`Priority`.

        Raises:
            InvalidPriority: anything else, including bare Celery priority numbers: a caller
                must name a class so that timeouts and metrics stay meaningful.
        """
        if isinstance(value, Priority):
            return value
        found = _BY_LABEL.get(value) if type(value) is str else None  # the usual spelling
        if found is not None:
            return found
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        valid = ", ".join(p.label for p in cls)
        raise InvalidPriority(f"unknown priority {value!r}; expected one of: {valid}")

    def celery_priority(self, settings: Settings) -> int:
        """The Celery message priority (0-9, 0 first) configured for this class."""
        return settings.priorities[self.label].celery_priority

    def default_timeout_s(self, settings: Settings) -> float | None:
        """The class's default timeout in seconds, or ``None`` when the class has none."""
        t = settings.priorities[self.label].timeout_s
        return t if t > 0 else None


_LABELS = {p: p.name.lower() for p in Priority}


_BY_LABEL = {label: p for p, label in _LABELS.items()}


# orjson's options here: datetimes, dataclasses and builtins' subclasses reach ``refuse``
OPTIONS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS


OPTIONS |= orjson.OPT_PASSTHROUGH_SUBCLASS


_TAG = b'"__type__"'


def refuse(obj: Any) -> Any:
    """orjson's ``default``: every type it leaves aside is refused (``TypeError``), for
    ``json``/kombu to write."""
    raise TypeError(f"{type(obj).__name__} is left to kombu's encoder")


def kombu_dumps(obj: Any) -> str:
    """kombu's own JSON text (imported here: the worker's Celery-free parts import this
    module and must not pull kombu in)."""
    from kombu.utils.json import dumps as _dumps

    return _dumps(obj)


def kombu_loads(data: bytes | str) -> Any:
    """kombu's own JSON reading (imported here, as :func:`kombu_dumps`)."""
    from kombu.utils.json import loads as _loads

    return _loads(data)


def dumps(obj: Any) -> str:
    """``obj`` as a JSON text equal in value to ``kombu.utils.json.dumps(obj)``.

    orjson writes it. A non-finite float is kombu's to write (``NaN``, ``Infinity``; orjson
    writes ``null``), so a text with more ``null`` than ``obj``'s own top-level ``None``
    values (a dict's: each is one ``null``) is checked for one (:func:`has_nonfinite`); a
    text without is not walked (a result document's one ``null`` is its ``traceback``).

    Raises:
        TypeError: kombu's encoder cannot encode ``obj`` either.
    """
    try:
        raw = orjson.dumps(obj, default=refuse, option=OPTIONS)
    except (TypeError, orjson.JSONEncodeError):  # odd types, 64-bit overflow: kombu decides
        return kombu_dumps(obj)
    if raw.count(b"null") > _nones(obj) and has_nonfinite(obj):
        return kombu_dumps(obj)
    return raw.decode()


def _nones(obj: Any) -> int:
    """How many ``null`` orjson writes for ``obj``'s own ``None`` values at its top level."""
    if type(obj) is dict:
        return sum(v is None for v in obj.values())
    return 1 if obj is None else 0


def dumps_event(obj: Any) -> str:
    """A Celery event message (or a list of them) as JSON, written by orjson without the
    non-finite check of :func:`dumps`: an event's floats are timestamps, offsets and
    run times the process takes itself, its other values strings, ids and counts, so an
    event never holds a NaN (one would be written ``null``). The check walked every field of
    every event a worker sends, three events per request (``task.multi`` carries a
    ``parent_id`` of ``null``, so the ``null`` shortcut of :func:`compact` does not apply).

    Raises:
        TypeError: kombu's encoder cannot encode ``obj`` either.
    """
    try:
        return orjson.dumps(obj, default=refuse, option=OPTIONS).decode()
    except (TypeError, orjson.JSONEncodeError):
        return kombu_dumps(obj)


def compact(obj: Any) -> bytes:
    """``obj`` as compact JSON in UTF-8: equal in value to ``json.dumps(obj,
    separators=(",", ":"), allow_nan=False)``, and refusing what it refuses (a request's
    inputs on the wire, and their size against ``[limits] max_inline_bytes``).

    orjson writes it; what orjson leaves aside (types JSON lacks, builtins' subclasses,
    non-string keys, integers beyond 64 bits) is written by ``json.dumps``. orjson writes a
    non-finite float as ``null``, so a text with ``null`` in it is checked for one.

    Raises:
        TypeError: a value JSON has no form for.
        ValueError: a NaN or infinite float.
    """
    try:
        data = orjson.dumps(obj, default=refuse, option=OPTIONS)
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    if b"null" in data and has_nonfinite(obj):
        raise ValueError("Out of range float values are not JSON compliant")
    return data


def loads(data: bytes | str) -> Any:
    """A JSON document written by :func:`dumps` or by kombu, as ``kombu.utils.json.loads``
    reads it.

    Raises:
        ValueError: not JSON (kombu's error).
    """
    raw = data.encode() if isinstance(data, str) else data
    if _TAG not in raw:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:  # NaN/Infinity, or not JSON: kombu decides
            pass
    return kombu_loads(data)


_SCALARS = frozenset({str, int, bool, type(None)})


def has_nonfinite(obj: Any) -> bool:
    """Whether a float in ``obj`` (nested dicts, lists, tuples) is NaN or infinite.

    One loop over an explicit stack (no recursion, no generator per container): a document
    whose text holds a ``null`` not its own is checked (:func:`dumps`, :func:`compact`), and
    most of its values are strings. A list of
    floats is checked by its sum first (one C loop); a non-finite sum (or one that overflowed)
    falls back to checking each element.
    """
    stack = [obj]
    pop, push = stack.pop, stack.extend
    while stack:
        o = pop()
        t = type(o)
        if t in _SCALARS:
            continue
        if isinstance(o, float):
            if not math.isfinite(o):
                return True
        elif isinstance(o, dict):
            push(o.values())
        elif isinstance(o, list | tuple):
            if o and type(o[0]) is float:
                try:
                    if math.isfinite(sum(o)):
                        continue
                except TypeError:  # not all numbers
                    pass
            push(o)
    return False


def decode_result(backend: Any, data: bytes | str) -> dict[str, Any]:
    """A stored result document as ``backend.decode_result(data)`` returns it (Celery's
    result meta), read by :func:`loads` where the backend's serializer is JSON.

    Raises:
        ValueError: not a JSON document (kombu's error).
    """
    if getattr(backend, "serializer", None) != "json":
        return backend.decode_result(data)
    return backend.meta_from_decoded(loads(data))


PRIORITY_STEPS: list[int] = list(range(10))


PRIORITY_SEP = "\x06\x16"  # kombu's default separator; kept so plain Celery clients interoperate


TASK_PREFIX = "fleet."


# Poison accounting (workers.batching.admission.InFlight): each worker process incarnation's
# records of the task ids it is decoding or running, and the set of every record's name.
BLAME_PREFIX = "fleet:blame:"
BLAME_INDEX_KEY = "fleet:blame:index"


RESULT_KEY_PREFIX = "celery-task-meta-"  # Celery's Redis result backend key


FINAL_KEY_PREFIX = "fleet:final:"  # SET NX by the first final result: later ones are dropped


# kombu's Redis transport: the unacked hash (tag -> [payload, exchange, routing_key]), its
# index (tag scored by delivery or, with leases, last renewal time) and the restore mutex.
UNACKED_KEY = "unacked"


UNACKED_INDEX_KEY = "unacked_index"


# Sorted set per modality: node name scored by its last heartbeat (unix s), written by each
# batching worker that consumes the modality's own queue (its default model's) with its lease
# renewals (workers.consumer.lease); live = younger than lease_s. One more per model a worker
# serves, ``fleet:live:<modality>@<table>`` (live_key).
LIVE_PREFIX = "fleet:live:"


LIVE_FORGET_S = 3600.0  # members silent this long are dropped from the set


# A worker pushes and deletes such a key once to learn whether Redis sends keyspace
# notifications (workers.consumer.channel), without CONFIG, which its ACL user may not run.
NOTIFY_PROBE_PREFIX = "fleet:notify-probe:"


JOB_KEY_PREFIX = "fleet:job:"  # the gateway's job document, written before it queues a request


def task_name(modality: str) -> str:
    """The Celery task name for a modality: ``fleet.text``."""
    return f"{TASK_PREFIX}{modality}"


def queue_name(modality: str) -> str:
    """The Celery queue of a modality; the same string."""
    return modality


def realtime_queue_name(modality: str) -> str:
    """The queue of a modality's REALTIME requests: ``text.realtime``.

    REALTIME requests travel apart so that a worker can read them on a channel whose
    prefetch window lower-priority messages never fill (see ``workers.consumer.realtime``).
    """
    return f"{modality}.realtime"


MODEL_QUEUE_SEP = "@"


def model_queue_name(modality: str, model: str | None = None) -> str:
    """The queue of one model of a modality that is not its default: ``text@bge-small``
    (``None``: the modality's own queue, its default model's). See ``shared.model_routes``."""
    return modality if model is None else f"{modality}{MODEL_QUEUE_SEP}{model}"


def queue_for(modality: str, priority_label: str, model: str | None = None) -> str:
    """The queue a request of ``priority_label`` (``"realtime"``, ...) is sent to; ``model``:
    a non-default model's table name (``None``: the modality's default model)."""
    queue = model_queue_name(modality, model)
    return realtime_queue_name(queue) if priority_label == "realtime" else queue


def priority_list_key(queue: str, celery_priority: int) -> str:
    """The Redis list that holds ``queue``'s messages at one Celery priority step."""
    return queue if celery_priority == 0 else f"{queue}{PRIORITY_SEP}{celery_priority}"


def blame_record_key(incarnation: str, slot: str) -> str:
    """The blame record of one worker process incarnation's ``slot`` (``decode`` or a lane)."""
    return f"{BLAME_PREFIX}{incarnation}:{slot}"


def result_key(task_id: str) -> str:
    return f"{RESULT_KEY_PREFIX}{task_id}"


def live_key(modality: str, model: str | None = None) -> str:
    """The liveness set of ``modality``'s workers (see ``LIVE_PREFIX``); with ``model`` (a
    ``[models.<name>]`` table name, the default model's too), of the workers serving it:
    ``fleet:live:text@bge-small``."""
    if model is None:
        return f"{LIVE_PREFIX}{modality}"
    return f"{LIVE_PREFIX}{modality}{MODEL_QUEUE_SEP}{model}"


def job_key(task_id: str) -> str:
    """The gateway's job document of ``task_id`` (``producer.gateway.jobs``)."""
    return f"{JOB_KEY_PREFIX}{task_id}"


def final_key(task_id: str) -> str:
    """Marks that ``task_id`` has its final result (``workers.batching.completion``: first one
    wins)."""
    return f"{FINAL_KEY_PREFIX}{task_id}"
