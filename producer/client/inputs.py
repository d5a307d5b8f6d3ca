"""Request inputs and results that carry files or tensors: image, video and cross-modal
inputs (a video above :data:`VIDEO_INLINE_MAX_BYTES` through /dev/shm), tensor wire objects in
results turned into numpy arrays, and the walk that finds wire objects (:func:`tensor_wires`,
``shared.tensor_wire.iter_wires``).

No torch; numpy and ``shared.transport`` are imported only when a tensor is at hand. Import
these names from ``producer.client``.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.tensor_wire import INLINE, SHM, is_wire
from shared.tensor_wire import iter_wires as tensor_wires

if TYPE_CHECKING:
    from shared.transport import ShmStore

__all__ = [
    "VIDEO_INLINE_MAX_BYTES",
    "image_inputs",
    "resolve_tensors",
    "tensor_wires",
    "video_inputs",
    "xmodal_inputs",
]


def image_inputs(path_or_bytes: str | Path | bytes) -> dict[str, Any]:
    """Inputs for an image request from a file path or the file's bytes."""
    data = path_or_bytes if isinstance(path_or_bytes, bytes) else Path(path_or_bytes).read_bytes()
    return {"image_b64": base64.b64encode(data).decode("ascii")}


VIDEO_INLINE_MAX_BYTES = 32 * 1024
"""Video files up to this size travel inline as base64 (about 44 KB in the message), larger
ones through /dev/shm, so a task message stays under 64 KB whatever the video's size."""


def video_inputs(
    path_or_bytes: str | Path | bytes,
    store: ShmStore | None = None,
    *,
    inline_max_bytes: int = VIDEO_INLINE_MAX_BYTES,
    ttl_s: float | None = None,
    request_id: str | None = None,
) -> dict[str, Any]:
    """Inputs for a video request from a file path or the file's bytes.

    Args:
        path_or_bytes: the encoded video file (MP4/MOV, MKV/WebM, AVI, MPEG-TS).
        store: where to put files above ``inline_max_bytes`` (``{"video_ref": ...}``, a
            detached 1-D uint8 segment); ``None``: always inline (``{"video_b64": ...}``,
            bounded by ``limits.max_inline_bytes`` at submit).
        inline_max_bytes: largest file sent inline when a store is given.
        ttl_s: the segment's lifetime (default: the store's); the worker must map it before,
            unless its lease is renewed (``request_id``).
        request_id: the task id of the request that will carry it: its TTL is then renewed
            while that request may still run (see ``shared.transport.lifetime``).

    The caller owns the segment: release it after the request's final outcome
    (``ResultHandle.get`` and ``FleetClient.release_inputs`` do), else its TTL reclaims it.

    Raises:
        ShmCapacityError: the shared-memory budget is exhausted.
    """
    data = path_or_bytes if isinstance(path_or_bytes, bytes) else Path(path_or_bytes).read_bytes()
    if store is None or len(data) <= inline_max_bytes:
        return {"video_b64": base64.b64encode(data).decode("ascii")}
    import numpy as np

    ref = store.put(
        np.frombuffer(data, dtype=np.uint8), ttl_s=ttl_s, detach=True, request_id=request_id
    )
    return {"video_ref": ref.to_dict()}


def xmodal_inputs(image: str | Path | bytes, texts: str | Sequence[str]) -> dict[str, Any]:
    """Inputs for a cross-modal request: an image (path or bytes) and 1-16 texts."""
    out = image_inputs(image)
    out["texts"] = [texts] if isinstance(texts, str) else list(texts)
    return out


def resolve_tensors(obj: Any, store: Callable[[], ShmStore], *, release: bool = True) -> Any:
    """A copy of ``obj`` (a result) with every tensor wire object replaced by a numpy array.

    Args:
        obj: a JSON-like value (dicts, lists, scalars).
        store: returns the :class:`ShmStore` to map refs with (called only if there is one).
        release: release each mapped segment at once (the mapping stays valid; tmpfs frees
            the pages when the array is garbage-collected).

    Raises:
        TensorRefError: an unknown, expired or malformed ref.
        InvalidInput: a malformed inline tensor.
    """
    if isinstance(obj, dict):
        if is_wire(obj, SHM):
            s = store()
            arr = s.get(obj)
            if release:
                s.release(obj)
            return arr
        if is_wire(obj, INLINE):
            from shared.transport import decode_inline

            return decode_inline(obj)
        return {k: resolve_tensors(v, store, release=release) for k, v in obj.items()}
    if isinstance(obj, list) and obj and isinstance(obj[0], dict | list):
        return [resolve_tensors(v, store, release=release) for v in obj]
    return obj
