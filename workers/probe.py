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

from shared.errors import InvalidInput
from shared.probe import PROBE_TASK, byte_checksum
from shared.settings import Settings
from shared.tensor_wire import INLINE, SHM
from shared.transport import decode_inline, process_store

__all__ = ["PROBE_TASK", "byte_checksum", "read_tensor"]


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
