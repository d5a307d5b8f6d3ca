"""Tensor transport: zero-copy shared-memory segments, with an inline fallback.

- :class:`ShmStore` writes a tensor once as an Arrow IPC file under ``/dev/shm/mmfleet-<uid>``
  and maps it in any process on the host without copying (:meth:`ShmStore.get`,
  :meth:`ShmStore.get_torch`); messages carry a :class:`TensorRef` (``ref.to_dict()``).
- :func:`encode_inline` / :func:`decode_inline` put the raw bytes in the message itself, for
  hosts that share no /dev/shm, bounded by a size limit.

Both wire forms are JSON objects told apart by ``"kind"``: ``"shm"`` or ``"inline"``.
Importing this package never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from shared.transport.inline import decode_inline, encode_inline
from shared.transport.ref import ALLOWED_DTYPES, TensorRef
from shared.transport.shm import SegmentInfo, ShmStore, default_root

if TYPE_CHECKING:
    from shared.settings import Settings


def store_from_settings(
    settings: Settings, role: Literal["producer", "worker"] = "producer"
) -> ShmStore:
    """A :class:`ShmStore` configured from ``[transport]`` (root, byte budget, TTL).

    Raises:
        TransportError: the root cannot be used (see :class:`ShmStore`).
    """
    t = settings.transport
    return ShmStore(
        root=t.shm_root,
        capacity_bytes=t.capacity_bytes,
        default_ttl_s=t.default_ttl_s,
        capacity_fraction=t.capacity_fraction,
        role=role,
        recycle_bytes=t.recycle_bytes,
    )


__all__ = [
    "ALLOWED_DTYPES",
    "SegmentInfo",
    "ShmStore",
    "TensorRef",
    "decode_inline",
    "default_root",
    "encode_inline",
    "store_from_settings",
]
