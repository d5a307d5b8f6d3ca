"""Result documents as JSON, fast: orjson where it gives the document kombu's JSON would, and
kombu's own codec where it might not.

A final result is Celery's result meta whose ``result`` usually holds float lists (an
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
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

__all__ = ["OPTIONS", "compact", "decode_result", "dumps", "has_nonfinite", "loads", "refuse"]

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

    Raises:
        TypeError: kombu's encoder cannot encode ``obj`` either.
    """
    if has_nonfinite(obj):
        return kombu_dumps(obj)
    try:
        return orjson.dumps(obj, default=refuse, option=OPTIONS).decode()
    except (TypeError, orjson.JSONEncodeError):  # odd types, 64-bit overflow: kombu decides
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


def has_nonfinite(obj: Any) -> bool:
    """Whether a float in ``obj`` (nested dicts, lists, tuples) is NaN or infinite.

    A list of floats is checked by its sum first (one C loop); a non-finite sum (or one that
    overflowed) falls back to checking each element.
    """
    if isinstance(obj, float):
        return not math.isfinite(obj)
    if isinstance(obj, dict):
        return any(has_nonfinite(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        if obj and type(obj[0]) is float:
            try:
                if math.isfinite(sum(obj)):
                    return False
            except TypeError:  # not all numbers
                pass
        return any(has_nonfinite(v) for v in obj)
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
