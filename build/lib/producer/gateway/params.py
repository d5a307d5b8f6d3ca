"""Request parameters: OIP ``priority`` and ``timeout``, ``Prefer``, request ids. Pure logic.

Priority (``parameters.priority``, an integer, 1 = highest, as Triton's scheduler reads it)
maps onto the fleet's four classes:

========================== ==========
``parameters.priority``    class
========================== ==========
absent or 0 (the default)  normal
1                          realtime
2                          high
3                          normal
4 and above                bulk
========================== ==========

A class name (``"realtime"``, ``"high"``, ``"normal"``, ``"bulk"``) is accepted as well.
``parameters.timeout`` is in microseconds (Triton's unit) and becomes the request's deadline
(``submitted + timeout``); absent or 0 means the class default (``[priorities.*]``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from shared.errors import InvalidInput, InvalidPriority
from shared.settings import PRIORITY_NAMES

_BY_LEVEL = {1: "realtime", 2: "high", 3: "normal"}
# Task ids become Redis key suffixes and URL path segments: a conservative alphabet.
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def priority_class(value: Any) -> str:
    """The class name for an OIP ``priority`` parameter (see the module docstring).

    Raises:
        InvalidPriority: not a non-negative integer or a class name (bools and floats with a
            fraction are refused).
    """
    if value is None:
        return "normal"
    if isinstance(value, str):
        if value.lower() in PRIORITY_NAMES:
            return value.lower()
        raise InvalidPriority(
            f"priority {value!r} is not an integer >= 0 or one of {', '.join(PRIORITY_NAMES)}"
        )
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidPriority(f"priority must be an integer >= 0 (1 = highest), not {value!r}")
    if value == 0:
        return "normal"
    return _BY_LEVEL.get(value, "bulk")


def timeout_seconds(value: Any) -> float | None:
    """``parameters.timeout`` (microseconds) in seconds; ``None`` for absent or 0.

    Raises:
        InvalidInput: negative, not a finite number, or a bool.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidInput(f"timeout must be a number of microseconds, not {value!r}")
    if value < 0:
        raise InvalidInput(f"timeout must be >= 0 microseconds, not {value!r}")
    return None if value == 0 else float(value) / 1e6


@dataclass(frozen=True, slots=True)
class Prefer:
    """The ``Prefer`` header (RFC 7240): ``respond-async`` and ``wait=N`` (seconds)."""

    respond_async: bool = False
    wait_s: float | None = None


def parse_prefer(headers: list[str]) -> Prefer:
    """Parse every ``Prefer`` header value. Unknown preferences are ignored (RFC 7240), and so
    is a ``wait`` that is not a non-negative number."""
    respond_async = False
    wait_s: float | None = None
    for header in headers:
        for part in header.split(","):
            token = part.split(";", 1)[0].strip().lower()
            if token == "respond-async":
                respond_async = True
            elif token.startswith("wait="):
                try:
                    w = float(token[5:].strip().strip('"'))
                except ValueError:
                    continue
                if math.isfinite(w) and w >= 0:
                    wait_s = w
    return Prefer(respond_async, wait_s)


def wait_budget(prefer: Prefer, timeout_s: float | None, default_s: float, max_s: float) -> float:
    """How long a synchronous infer waits for its result before answering 202 (seconds):
    ``Prefer: wait=N``, else the request's own timeout (its deadline), else ``default_s``;
    at most ``max_s``."""
    if prefer.wait_s is not None:
        w = prefer.wait_s
    elif timeout_s is not None:
        w = timeout_s
    else:
        w = default_s
    return min(w, max_s)


def check_request_id(value: Any, what: str = "id") -> str:
    """A client-chosen request id (OIP ``id`` or ``Idempotency-Key``), which becomes the
    task id.

    Raises:
        InvalidInput: not a string of 1-128 characters from ``[A-Za-z0-9._:-]`` starting
            with a letter or digit.
    """
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise InvalidInput(
            f"{what} must be 1-128 characters of [A-Za-z0-9._:-], starting with a letter or "
            f"digit; got {str(value)[:40]!r}"
        )
    return value
