"""Inline tensors: raw bytes through the broker, for hosts that share no /dev/shm.

Wire format (a JSON object with exactly these keys)::

    {"kind": "inline",         # discriminator; shared-memory refs use "shm"
     "dtype": "float32",       # numpy dtype name, one of ALLOWED_DTYPES
     "shape": [3, 4],          # list of non-negative ints; [] for a 0-d tensor
     "nbytes": 48,             # == prod(shape) * itemsize, in bytes
     "b64": "AAAA..."}         # standard base64 (RFC 4648, padded) of the C-order,
                               # little-endian raw bytes; bool is one byte per element (0 or 1)

The size limit applies to the raw bytes (``nbytes``); the base64 text is 4/3 of that.
Every inline tensor costs an encode copy, the broker round trip and a decode copy, which is
why tensors above the limit must go through :class:`shared.transport.ShmStore` instead.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

import numpy as np

from shared.errors import InvalidInput, PayloadTooLarge
from shared.tensor_wire import INLINE, INLINE_KEYS
from shared.transport._arrays import as_c_array
from shared.transport.ref import ALLOWED_DTYPES, DTYPE_ITEMSIZE, numel

__all__ = [
    "decode_inline",
    "encode_inline",
]

_WIRE_KEYS = INLINE_KEYS
_MAX_NDIM = 32


def encode_inline(array: Any, max_bytes: int) -> dict[str, Any]:
    """Encode a tensor as an inline JSON object (see the module docstring).

    Args:
        array: a numpy array or scalar, or a torch tensor (duck-typed; torch not imported),
            of a dtype in ``ALLOWED_DTYPES``; any shape, including 0-d and empty.
        max_bytes: the largest raw size accepted, in bytes (``[limits] max_inline_bytes``).

    Returns:
        The JSON-able dict; ``b64`` is about ``4/3 * nbytes`` characters.

    Raises:
        PayloadTooLarge: ``array.nbytes > max_bytes`` (checked before anything is encoded).
        InvalidInput: an unsupported type or dtype.
    """
    arr = as_c_array(array)
    if arr.nbytes > max_bytes:
        raise PayloadTooLarge(
            f"tensor of {arr.nbytes} bytes exceeds the inline limit of {max_bytes} bytes; "
            "send it through shared memory (ShmStore.put) instead"
        )
    return {
        "kind": INLINE,
        "dtype": arr.dtype.name,
        "shape": list(arr.shape),
        "nbytes": int(arr.nbytes),
        # A flat uint8 view of the C-contiguous array: raw bytes without a tobytes() copy
        # (memoryview.cast refuses empty shapes, reshape/view do not).
        "b64": base64.b64encode(arr.reshape(-1).view(np.uint8)).decode("ascii"),
    }


def decode_inline(d: object, max_bytes: int | None = None) -> np.ndarray:
    """Decode an inline tensor object into a new, writable numpy array.

    Args:
        d: the wire object (see the module docstring).
        max_bytes: if given, refuse payloads whose declared or encoded size exceeds it
            (checked before the base64 text is decoded).

    Returns:
        An array of ``d["shape"]`` and ``d["dtype"]`` that owns its memory.

    Raises:
        PayloadTooLarge: ``nbytes`` or the base64 length exceeds ``max_bytes``.
        InvalidInput: not a mapping, missing or extra keys, a dtype outside
            ``ALLOWED_DTYPES``, a bad shape, ``nbytes != prod(shape) * itemsize``, invalid
            base64, a decoded length other than ``nbytes``, or bool bytes other than 0/1.
    """
    if not isinstance(d, Mapping):
        raise InvalidInput(f"an inline tensor must be an object, got {type(d).__name__}")
    if set(d) != _WIRE_KEYS:
        raise InvalidInput(f"inline tensor keys must be exactly {sorted(_WIRE_KEYS)}")
    kind, dtype, shape, nbytes, b64 = (d[k] for k in ("kind", "dtype", "shape", "nbytes", "b64"))
    if kind != INLINE:
        raise InvalidInput(f"inline tensor kind must be 'inline', got {str(kind)[:20]!r}")
    if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:
        raise InvalidInput(f"inline tensor dtype must be one of {sorted(ALLOWED_DTYPES)}")
    if (
        not isinstance(shape, list | tuple)
        or len(shape) > _MAX_NDIM
        or not all(type(x) is int and x >= 0 for x in shape)  # type(): rejects bools
    ):
        raise InvalidInput("inline tensor shape must be a list of non-negative ints")
    if type(nbytes) is not int:
        raise InvalidInput("inline tensor nbytes must be an int")
    expected = numel(tuple(shape)) * DTYPE_ITEMSIZE[dtype]
    if nbytes != expected:
        raise InvalidInput(f"inline tensor nbytes {nbytes} != prod(shape) * itemsize = {expected}")
    if not isinstance(b64, str):
        raise InvalidInput("inline tensor b64 must be a string")
    if max_bytes is not None and (nbytes > max_bytes or len(b64) > 4 * (max_bytes // 3 + 1)):
        raise PayloadTooLarge(f"inline tensor exceeds the limit of {max_bytes} bytes")
    if len(b64) != 4 * ((nbytes + 2) // 3):
        # Cheap length check first: padded base64 of n bytes is exactly 4*ceil(n/3) chars.
        raise InvalidInput(f"inline tensor b64 length does not match nbytes {nbytes}")
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput("inline tensor b64 is not valid base64") from None
    if len(raw) != nbytes:
        raise InvalidInput(f"inline tensor decodes to {len(raw)} bytes, expected {nbytes}")
    # bytearray: the result owns writable memory (np.frombuffer over bytes is read-only).
    arr = np.frombuffer(bytearray(raw), dtype=np.dtype(dtype)).reshape(tuple(shape))
    if dtype == "bool" and arr.size and bool((arr.view(np.uint8) > 1).any()):
        # numpy bools must hold 0 or 1; anything else gives inconsistent results later.
        raise InvalidInput("inline bool tensor holds bytes other than 0 and 1")
    return arr
