"""Tensor transport: zero-copy shared-memory segments, with an inline fallback.

- :class:`ShmStore` writes a tensor once as an Arrow IPC file under ``/dev/shm/mmfleet-<uid>``
  and maps it in any process on the host without copying (:meth:`ShmStore.get`,
  :meth:`ShmStore.get_torch`); messages carry a :class:`TensorRef` (``ref.to_dict()``).
- :func:`encode_inline` / :func:`decode_inline` put the raw bytes in the message itself, for
  hosts that share no /dev/shm, bounded by a size limit.

Both wire forms are JSON objects told apart by ``"kind"``: ``"shm"`` or ``"inline"``.
Importing this package never imports torch.

Modules, one concern each (the store's parts first, then what they build on)::

    shm.py        ShmStore: the facade; put = encode -> reserve -> write -> publish
    segment.py    the segment format: metadata, Arrow checks (extension types refused),
                  encoding and view building, as pure functions
    root.py       the fleet directory: layout, security checks, root lock, capacity budget
    writer.py     put's reserve -> write -> publish, on a temp file; ENOSPC -> SHM_CAPACITY
    pool.py       recycling: the pool of released files and the writer's kept mappings
    reader.py     get's open -> lock -> map (or the reader cache) -> checked view
    mapcache.py   the reader cache of mappings of recycled files
    inventory.py  info / ls / gc: metadata from the footer, stale and orphaned files
    locks.py      flock helpers, the Sweeper thread, the one fork hook (ForkAware)
    lifetime.py   leases of segments bound to a request (renewed while it may run)
    ref.py        TensorRef, ids and owners (no numpy, no pyarrow)
    inline.py     the inline wire form
    _arrays.py    numpy / torch input -> C-contiguous array

Process liveness (a segment's owner, a writer's temp file) comes from :mod:`shared.procs`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Literal

from shared.transport.inline import decode_inline, encode_inline
from shared.transport.inventory import SegmentInfo
from shared.transport.ref import ALLOWED_DTYPES, TensorRef
from shared.transport.root import default_root
from shared.transport.shm import ShmStore

if TYPE_CHECKING:
    from shared.settings import Settings


def store_from_settings(
    settings: Settings, role: Literal["producer", "worker"] = "producer"
) -> ShmStore:
    """A new :class:`ShmStore` configured from ``[transport]`` (root, byte budget, TTL,
    lifetime cap, recycling, reader cache).

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
        # Workers read every input once per task from files producers rewrite; a producer
        # reads each output once: a cache would only hold its descriptors.
        reader_cache_bytes=t.reader_cache_bytes if role == "worker" else 0,
        max_lifetime_s=t.max_ref_lifetime_s,
    )


_process_stores: dict[tuple[str, str], ShmStore] = {}
_process_stores_lock = threading.Lock()


def process_store(settings: Settings, role: Literal["producer", "worker"] = "worker") -> ShmStore:
    """The one :class:`ShmStore` of this process for these ``[transport]`` settings and role.

    A worker reads every input through it, so its reader cache (and a recycling store's kept
    mappings) serve every task of the process, not just one call.

    Raises:
        TransportError: the root cannot be used (see :class:`ShmStore`).
    """
    key = (settings.transport.model_dump_json(), role)
    with _process_stores_lock:
        store = _process_stores.get(key)
        if store is None:
            store = _process_stores[key] = store_from_settings(settings, role)
        return store


__all__ = [
    "ALLOWED_DTYPES",
    "SegmentInfo",
    "ShmStore",
    "TensorRef",
    "decode_inline",
    "default_root",
    "encode_inline",
    "process_store",
    "store_from_settings",
]
