"""``fleet.transport_probe``: a task that receives one tensor and reads all of it.

Used by the benchmark's ``transport`` workload to time producer -> worker -> result for a
tensor sent through /dev/shm (a TensorRef) or inline through Redis (base64 in the message),
against one ``memcpy`` of the same bytes. The worker maps or decodes the tensor and reads every
byte (a full read, so a lazy mapping cannot hide a cost) into a checksum, which it returns:
the producer checks it against the bytes it sent.

Registered on every worker; it runs with Celery's default strategy (no batching), on the
queue the caller names.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shared.errors import InvalidInput
from shared.settings import Settings
from shared.tensor_wire import INLINE, SHM
from shared.transport import decode_inline, process_store

PROBE_TASK = "fleet.transport_probe"


def byte_checksum(arr: np.ndarray) -> int:
    """The sum, modulo 2**64, of ``arr``'s raw bytes read as little-endian uint64 words (the
    last partial word zero-padded): reads every byte once, at memory bandwidth.

    A float64 sum of the elements was the first probe; for a float32 tensor it converts
    every element and took 21-36 ms for 128 MiB here, against 4.7 ms for this in cache.
    Equal bytes give equal checksums on every host; any single changed word changes it.

    Args:
        arr: any C-contiguous array (a mapped segment: nothing is copied).
    """
    raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    whole = raw.size // 8 * 8
    total = int(np.add.reduce(raw[:whole].view("<u8"), dtype=np.uint64)) if whole else 0
    tail = raw[whole:]
    if tail.size:
        total += int.from_bytes(tail.tobytes() + bytes(8 - tail.size), "little")
    return total % 2**64


def read_tensor(settings: Settings, wire: dict[str, Any]) -> dict[str, Any]:
    """Map (shm) or decode (inline) ``wire`` and read every byte.

    Returns:
        ``{"kind", "nbytes", "shape", "dtype", "checksum"}``; ``checksum`` is
        :func:`byte_checksum` of the tensor as received.

    Raises:
        InvalidInput: ``wire`` is neither a shm TensorRef nor an inline tensor.
        TensorRefError: the ref is malformed, unknown or expired.
    """
    kind = wire.get("kind") if isinstance(wire, dict) else None
    if kind == SHM:
        arr = process_store(settings, role="worker").get(wire)
    elif kind == INLINE:
        arr = decode_inline(wire, max_bytes=settings.limits.max_inline_bytes * 64)
    else:
        raise InvalidInput("probe input must be a {'kind': 'shm'|'inline', ...} tensor")
    return {
        "kind": kind,
        "nbytes": int(arr.nbytes),
        "shape": list(arr.shape),
        "dtype": str(arr.dtype),
        "checksum": byte_checksum(arr),
    }
