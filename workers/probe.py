"""``fleet.transport_probe``: a task that receives one tensor and reads all of it.

Used by the benchmark's ``transport`` workload to time producer -> worker -> result for a
tensor sent through /dev/shm (a TensorRef) or inline through Redis (base64 in the message),
against one ``memcpy`` of the same bytes. The worker maps or decodes the tensor and sums every
element (a full read, so a lazy mapping cannot hide a cost), then returns the sum.

Registered on every worker; it runs with Celery's default strategy (no batching), on the
queue the caller names.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shared.errors import InvalidInput
from shared.settings import Settings
from shared.transport import decode_inline, store_from_settings

PROBE_TASK = "fleet.transport_probe"


def read_tensor(settings: Settings, wire: dict[str, Any]) -> dict[str, Any]:
    """Map (shm) or decode (inline) ``wire`` and read every element.

    Returns:
        ``{"kind", "nbytes", "shape", "dtype", "sum"}``; ``sum`` is float64.

    Raises:
        InvalidInput: ``wire`` is neither a shm TensorRef nor an inline tensor.
        TensorRefError: the ref is malformed, unknown or expired.
    """
    kind = wire.get("kind") if isinstance(wire, dict) else None
    if kind == "shm":
        arr = store_from_settings(settings, role="worker").get(wire)
    elif kind == "inline":
        arr = decode_inline(wire, max_bytes=settings.limits.max_inline_bytes * 64)
    else:
        raise InvalidInput("probe input must be a {'kind': 'shm'|'inline', ...} tensor")
    return {
        "kind": kind,
        "nbytes": int(arr.nbytes),
        "shape": list(arr.shape),
        "dtype": str(arr.dtype),
        "sum": float(np.sum(arr, dtype=np.float64)),
    }
