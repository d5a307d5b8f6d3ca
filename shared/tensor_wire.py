"""The tensor wire forms: how a message or a result tells a tensor reference from other JSON.

Two forms, JSON objects told apart by ``"kind"`` and recognised by their exact key sets:

- ``{"kind": "shm", ...}``: a :class:`shared.transport.TensorRef` (keys :data:`SHM_KEYS`;
  the fields are documented in :mod:`shared.transport.ref`);
- ``{"kind": "inline", ...}``: the raw bytes in base64 (keys :data:`INLINE_KEYS`; see
  :mod:`shared.transport.inline`).

This module only *recognises* the forms (:func:`is_wire`, :func:`iter_wires`); validating
and decoding them is ``TensorRef.from_dict`` / ``decode_inline``'s. It imports nothing
beyond the standard library, so the producer's client and CLI recognise wire objects without
loading numpy or pyarrow (``shared.transport`` does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

__all__ = [
    "INLINE",
    "INLINE_KEYS",
    "KINDS",
    "SHM",
    "SHM_KEYS",
    "WIRE_KEYS",
    "find_wires",
    "is_wire",
    "iter_wires",
]

SHM: Final = "shm"
"""``kind`` of a shared-memory :class:`shared.transport.TensorRef`."""

INLINE: Final = "inline"
"""``kind`` of an inline (base64) tensor."""

KINDS: Final = (SHM, INLINE)

SHM_KEYS: Final = frozenset(
    {"kind", "id", "shape", "dtype", "nbytes", "owner", "created_at", "ttl_s"}
)
INLINE_KEYS: Final = frozenset({"kind", "dtype", "shape", "nbytes", "b64"})

WIRE_KEYS: Final[Mapping[str, frozenset[str]]] = {SHM: SHM_KEYS, INLINE: INLINE_KEYS}
"""``kind`` -> the exact key set of that wire form."""


def is_wire(obj: object, kind: str | None = None) -> bool:
    """True when ``obj`` is a dict of the wire form ``kind`` (either form when ``None``):
    its ``"kind"`` names the form and its keys are exactly that form's. Values unchecked."""
    if not isinstance(obj, dict):
        return False
    found = obj.get("kind")
    if kind is not None and found != kind:
        return False
    keys = WIRE_KEYS.get(found) if isinstance(found, str) else None
    return keys is not None and set(obj) == keys


def find_wires(
    obj: Any, match: Callable[[Mapping[str, Any]], bool], max_depth: int | None = None
) -> Iterator[Mapping[str, Any]]:
    """Every mapping inside ``obj`` (nested mappings and lists) for which ``match`` holds,
    depth first; a matched mapping is not searched further.

    Args:
        obj: a JSON-like value.
        match: the test of a mapping (e.g. ``lambda o: is_wire(o, SHM)``).
        max_depth: nesting levels searched below ``obj`` (``None``: all).
    """
    yield from _find(obj, match, max_depth, 0)


def _find(
    obj: Any, match: Callable[[Mapping[str, Any]], bool], max_depth: int | None, depth: int
) -> Iterator[Mapping[str, Any]]:
    if max_depth is not None and depth > max_depth:
        return
    if isinstance(obj, Mapping):
        if match(obj):
            yield obj
            return
        for v in obj.values():
            yield from _find(v, match, max_depth, depth + 1)
    elif isinstance(obj, list):
        for v in obj:
            if isinstance(v, Mapping | list):
                yield from _find(v, match, max_depth, depth + 1)


def iter_wires(obj: Any, kind: str | None = None) -> Iterator[dict[str, Any]]:
    """Every tensor wire object of ``kind`` (either form when ``None``) inside ``obj``."""
    for found in find_wires(obj, lambda o: is_wire(o, kind)):
        if isinstance(found, dict):  # always: is_wire holds only for dicts
            yield found
