"""Tensor transport: zero-copy shared-memory segments, with an inline fallback.

- :class:`ShmStore` writes a tensor once as an Arrow IPC file under ``/dev/shm/mmfleet-<uid>``
  and maps it in any process on the host without copying (:meth:`ShmStore.get`,
  :meth:`ShmStore.get_torch`); messages carry a :class:`TensorRef` (``ref.to_dict()``).
- :func:`encode_inline` / :func:`decode_inline` put the raw bytes in the message itself, for
  hosts that share no /dev/shm, bounded by a size limit.

Both wire forms are JSON objects told apart by ``"kind"``: ``"shm"`` or ``"inline"``.
Importing this package never imports torch.
"""

from shared.transport.inline import decode_inline, encode_inline
from shared.transport.ref import ALLOWED_DTYPES, TensorRef
from shared.transport.shm import SegmentInfo, ShmStore, default_root

__all__ = [
    "ALLOWED_DTYPES",
    "SegmentInfo",
    "ShmStore",
    "TensorRef",
    "decode_inline",
    "default_root",
    "encode_inline",
]
