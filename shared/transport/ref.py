"""``TensorRef``: the small JSON object a message carries instead of a large tensor.

Wire format (a JSON object with exactly these keys; no others are accepted)::

    {"kind": "shm",                       # discriminator; inline tensors use "inline"
     "id": "t3f0c9a2b8d4e6f7a1b2c3d4e5f6a7b8c",  # "t" + 32 lowercase hex digits, never a path
     "shape": [2, 3, 224, 224],            # list of non-negative ints; [] for a 0-d tensor
     "dtype": "float32",                   # numpy dtype name, one of ALLOWED_DTYPES
     "nbytes": 1204224,                    # == prod(shape) * itemsize(dtype), in bytes
     "owner": "producer:host-1:4242",      # "<producer|worker>:<hostname>:<pid>"
     "created_at": 1764460800.123,         # Unix epoch seconds (wall clock of the writer)
     "ttl_s": 600.0}                       # seconds after created_at the segment may be reclaimed

A ref only resolves on the host (the /dev/shm) that wrote it. The reader builds the file
name from ``id`` alone, inside its own fleet directory, so a message can never name a path.

This module imports neither numpy nor pyarrow: producers validate refs cheaply.
"""

from __future__ import annotations

import math
import re
import secrets
import socket
from collections.abc import Mapping
from functools import cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from shared.errors import TensorRefError
from shared.tensor_wire import SHM_KEYS

__all__ = [
    "ALLOWED_DTYPES",
    "DTYPE_ITEMSIZE",
    "ID_PATTERN",
    "OWNER_PATTERN",
    "TensorRef",
    "hostname",
    "new_id",
    "numel",
    "owner_host",
    "owner_pid",
    "validate_id",
]

ID_PATTERN = re.compile(r"t[0-9a-f]{32}")
"""A segment id: ``t`` + 32 lowercase hex digits (128 random bits). Matched with fullmatch."""

OWNER_PATTERN = re.compile(r"(producer|worker):[A-Za-z0-9._-]{1,253}:[0-9]{1,10}")
"""An owner: ``<role>:<hostname>:<pid>``; hostname reduced to ``[A-Za-z0-9._-]``."""

DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
}
"""Allowed dtypes (numpy names) and their item sizes in bytes. bfloat16 is not supported."""

ALLOWED_DTYPES: frozenset[str] = frozenset(DTYPE_ITEMSIZE)

_WIRE_KEYS = SHM_KEYS
_MAX_NDIM = 32  # numpy's own limit is 64; no real tensor in this fleet comes near 32


def new_id() -> str:
    """A fresh random segment id (``t`` + 32 hex digits)."""
    return "t" + secrets.token_hex(16)


def validate_id(value: object) -> str:
    """Return ``value`` if it is a well-formed segment id.

    Raises:
        TensorRefError: not a ``str`` matching :data:`ID_PATTERN` (e.g. ``"../x"``, an
            absolute path, a wrong length, upper-case hex, a trailing ``/`` or newline).
    """
    if not isinstance(value, str) or ID_PATTERN.fullmatch(value) is None:
        raise TensorRefError(f"invalid tensor id {str(value)[:80]!r}")
    return value


def owner_pid(owner: str) -> int:
    """The pid part of an owner string (``"worker:h:42"`` -> 42)."""
    return int(owner.rsplit(":", 1)[1])


def owner_host(owner: str) -> str:
    """The hostname part of an owner string (``"worker:h:42"`` -> ``"h"``)."""
    return owner.split(":", 2)[1]


@cache
def hostname() -> str:
    """This host's name reduced to ``[A-Za-z0-9._-]`` (at most 64 chars), as used in owners."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64]
    return name or "localhost"


def numel(shape: tuple[int, ...]) -> int:
    """Number of elements of ``shape`` (1 for the 0-d shape ``()``)."""
    return math.prod(shape)


class TensorRef(BaseModel):
    """A reference to a tensor stored once in this host's shared memory (frozen).

    Build one with :meth:`shared.transport.ShmStore.put`; send :meth:`to_dict`; rebuild on
    the other side with :meth:`from_dict`, which raises :class:`TensorRefError` on anything
    malformed. See the module docstring for the wire format.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    kind: Literal["shm"] = "shm"
    id: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    owner: str
    created_at: float
    ttl_s: float

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if ID_PATTERN.fullmatch(v) is None:
            raise ValueError("id must be 't' followed by 32 lowercase hex digits")
        return v

    @field_validator("shape")
    @classmethod
    def _shape(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if len(v) > _MAX_NDIM:
            raise ValueError(f"at most {_MAX_NDIM} dimensions")
        if any(d < 0 for d in v):
            raise ValueError("dimensions must be >= 0")
        return v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v not in ALLOWED_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(ALLOWED_DTYPES)}")
        return v

    @field_validator("owner")
    @classmethod
    def _owner(cls, v: str) -> str:
        if OWNER_PATTERN.fullmatch(v) is None:
            raise ValueError(
                "owner must look like 'producer:<host>:<pid>' or 'worker:<host>:<pid>'"
            )
        return v

    @field_validator("created_at", "ttl_s")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v) or v < 0:
            raise ValueError("must be a finite number >= 0")
        return v

    @model_validator(mode="after")
    def _sizes(self) -> TensorRef:
        expected = numel(self.shape) * DTYPE_ITEMSIZE[self.dtype]
        if self.nbytes != expected:
            raise ValueError(
                f"nbytes {self.nbytes} != prod(shape) * itemsize = {expected} "
                f"for shape {list(self.shape)} and dtype {self.dtype}"
            )
        return self

    # -- derived -------------------------------------------------------------------------
    @property
    def expires_at(self) -> float:
        """Epoch seconds after which the segment may be reclaimed."""
        return self.created_at + self.ttl_s

    def expired(self, now: float) -> bool:
        """True when ``now`` (epoch seconds) is at or past :attr:`expires_at`."""
        return now >= self.expires_at

    # -- wire format ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON-able wire form (``shape`` as a list). See the module docstring."""
        return {
            "kind": self.kind,
            "id": self.id,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "nbytes": self.nbytes,
            "owner": self.owner,
            "created_at": self.created_at,
            "ttl_s": self.ttl_s,
        }

    @classmethod
    def from_dict(cls, d: object) -> TensorRef:
        """Parse the wire form; strict: exactly the documented keys and JSON types.

        ``shape`` may be a list or tuple of ints (not bools); ``created_at``/``ttl_s`` may be
        JSON ints or floats.

        Raises:
            TensorRefError: not a mapping, missing or extra keys, wrong types, a bad id or
                owner, a dtype outside :data:`ALLOWED_DTYPES`, a negative dimension or size,
                or ``nbytes != prod(shape) * itemsize``.
        """
        if not isinstance(d, Mapping):
            raise TensorRefError(f"a tensor ref must be an object, got {type(d).__name__}")
        keys = set(d)
        if keys != _WIRE_KEYS:
            missing = sorted(_WIRE_KEYS - keys)
            extra = sorted(str(k)[:40] for k in keys - _WIRE_KEYS)
            raise TensorRefError(f"tensor ref keys wrong: missing {missing}, unexpected {extra}")
        shape = d["shape"]
        if not isinstance(shape, list | tuple) or not all(
            type(x) is int
            for x in shape  # type() rather than isinstance: rejects bools
        ):
            raise TensorRefError("tensor ref shape must be a list of ints")
        if type(d["nbytes"]) is not int:
            raise TensorRefError("tensor ref nbytes must be an int")
        times = {}
        for key in ("created_at", "ttl_s"):
            v = d[key]
            if type(v) not in (int, float):
                raise TensorRefError(f"tensor ref {key} must be a number")
            times[key] = float(v)
        try:
            return cls(
                kind=d["kind"],
                id=d["id"],
                shape=tuple(shape),
                dtype=d["dtype"],
                nbytes=d["nbytes"],
                owner=d["owner"],
                **times,
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(map(str, first["loc"])) or "ref"
            raise TensorRefError(f"invalid tensor ref ({where}): {first['msg']}") from None
