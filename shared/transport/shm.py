"""``ShmStore``: zero-copy tensor segments in ``/dev/shm``, one Arrow IPC file per tensor.

The store wires the transport's parts together (see the package docstring): the segment
format (:mod:`.segment`), the root directory (:mod:`.root`), the write path (:mod:`.writer`),
recycling (:mod:`.pool`), the read path (:mod:`.reader`, :mod:`.mapcache`) and the inventory
(:mod:`.inventory`). A put is encode -> reserve -> write -> publish.
"""

from __future__ import annotations

import functools
import math
import os
import stat
import time
import warnings
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np

from shared.errors import TensorRefError, TransportError
from shared.procs import proc_start_time
from shared.transport import root as shm_root
from shared.transport import segment, writer
from shared.transport._arrays import as_c_array
from shared.transport.inventory import Inventory, SegmentInfo
from shared.transport.lifetime import validate_request_id
from shared.transport.mapcache import MappingCache
from shared.transport.pool import MIN_RECYCLE_BYTES, KeptMappings, Pool
from shared.transport.reader import Reader
from shared.transport.ref import OWNER_PATTERN, TensorRef, hostname, new_id, owner_host, owner_pid

if TYPE_CHECKING:
    import torch

__all__ = ["ShmStore"]

_F = TypeVar("_F", bound=Callable[..., Any])


def _os_errors_as_transport_errors(fn: _F) -> _F:
    """An ``OSError`` that escapes ``fn`` (out of descriptors, out of memory, a root removed
    underneath) becomes a :class:`TransportError` (``TRANSPORT_ERROR``): callers see a fleet
    error with a stable code, never a bare OSError."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OSError as exc:
            raise TransportError(f"shared-memory transport: {exc}") from exc

    return wrapper  # type: ignore[return-value]


class ShmStore:
    """Write tensors once into shared memory; map them anywhere on the host without copying.

    Args:
        root: the fleet directory (default :func:`~.root.default_root`). Created with mode
            0700 if missing; an existing one must be a real directory (not a symlink), owned
            by this uid, with mode exactly 0700.
        capacity_bytes: budget for all segments in ``root`` together, in bytes (file sizes,
            temp and pool files included). Default: ``capacity_fraction`` of the filesystem.
        default_ttl_s: lifetime of a segment when :meth:`put` is given none, in seconds.
        capacity_fraction: fraction of the filesystem used when ``capacity_bytes`` is None.
        role: ``"producer"`` or ``"worker"``, the first part of the default owner string.
        recycle_bytes: keep released segment files of at least 1 MiB, up to this many bytes
            in all, and write later segments into them (:mod:`.pool`). 0 (the default):
            released segments are unlinked at once.
        recycle_idle_s: :meth:`gc` unlinks pool files unused for this long, in seconds.
        reader_cache_bytes: keep read mappings of segments written by a recycling store, up
            to this many bytes, so that the next segment written into the same file is read
            through page tables that are ready (:mod:`.mapcache`). 0 (the default): every
            view has its own mapping, unmapped when the view goes.
        max_lifetime_s: renewals of a segment bound to a request never keep it past its
            write time plus this, in seconds (see :mod:`shared.transport.lifetime`).

    Raises:
        TransportError: the parent directory is missing (no /dev/shm: use the inline
            transport), or ``root`` is a symlink, not a directory, owned by another uid or
            not mode 0700.
        ValueError: a non-positive TTL, lifetime or fraction, or a negative capacity, recycle
            or reader cache budget.

    Besides its settings, the store keeps only the mappings of a recycling store and of its
    reader cache, which a forked child drops at the fork; so one instance may be created
    before a fork and used in the children (the owner pid is read at each put).
    """

    def __init__(
        self,
        root: Path | str | None = None,
        capacity_bytes: int | None = None,
        default_ttl_s: float = 600.0,
        *,
        capacity_fraction: float = 0.5,
        role: Literal["producer", "worker"] = "producer",
        recycle_bytes: int = 0,
        recycle_idle_s: float = 30.0,
        reader_cache_bytes: int = 0,
        max_lifetime_s: float = 86400.0,
    ) -> None:
        _check_settings(
            default_ttl_s, max_lifetime_s, capacity_fraction, capacity_bytes, role,
            recycle_bytes, recycle_idle_s, reader_cache_bytes,
        )  # fmt: skip
        self.recycle_bytes = int(recycle_bytes)
        self.recycle_idle_s = float(recycle_idle_s)
        self.root = Path(root) if root is not None else shm_root.default_root()
        self.default_ttl_s = float(default_ttl_s)
        self.max_lifetime_s = float(max_lifetime_s)
        self.role = role
        self._uid = os.getuid()
        _os_errors_as_transport_errors(shm_root.open_root)(self.root, self._uid)
        if capacity_bytes is None:
            capacity_bytes = int(self.fs_total_bytes() * capacity_fraction)
        self.capacity_bytes = int(capacity_bytes)
        self._lock = shm_root.RootLock(self.root)
        self._kept = KeptMappings(self.recycle_bytes)
        self._pool = Pool(
            self.root, self._lock, self._uid, self.recycle_bytes, self.recycle_idle_s, self._kept
        )
        self.reader_cache = MappingCache(reader_cache_bytes) if reader_cache_bytes else None
        self._reader = Reader(self.root, self._uid, self.reader_cache, self.max_lifetime_s)
        self._inventory = Inventory(self._reader, self._pool, self.default_ttl_s)
        self.kept_puts = 0  # puts written through a kept mapping (one memcpy)

    @property
    def default_owner(self) -> str:
        """``"<role>:<host>:<pid>"`` of the calling process."""
        return f"{self.role}:{hostname()}:{os.getpid()}"

    # -- capacity --------------------------------------------------------------------------
    def fs_total_bytes(self) -> int:
        """Size of the filesystem holding ``root`` (``/dev/shm``), in bytes."""
        return shm_root.fs_total_bytes(self.root)

    def fs_free_bytes(self) -> int:
        """Bytes still available on the filesystem holding ``root``."""
        return shm_root.fs_free_bytes(self.root)

    @_os_errors_as_transport_errors
    def used_bytes(self) -> int:
        """Bytes held by the root's files (see :func:`.root.used_bytes`)."""
        return shm_root.used_bytes(self.root)

    @_os_errors_as_transport_errors
    def check_capacity(self, min_bytes: int = shm_root.MIN_SHM_WARN_BYTES) -> str | None:
        """A warning for the startup log when /dev/shm cannot hold what the budget promises,
        or the budget is under ``min_bytes`` (default 256 MiB); None when all is well."""
        return shm_root.capacity_warning(self.root, self.capacity_bytes, min_bytes)

    # -- write -----------------------------------------------------------------------------
    @_os_errors_as_transport_errors
    def put(
        self,
        array: Any,
        *,
        ttl_s: float | None = None,
        owner: str | None = None,
        detach: bool = False,
        request_id: str | None = None,
    ) -> TensorRef:
        """Write a tensor once as a segment and return its ref.

        Args:
            array: a numpy array or scalar, or a torch tensor (duck-typed, any device), of a
                dtype in ``ALLOWED_DTYPES``; any shape, including 0-d and empty. A
                non-contiguous array is copied once into C order first.
            ttl_s: lifetime in seconds (default: ``default_ttl_s``); the janitor may reclaim
                the segment after it and :meth:`get` refuses it.
            owner: ``"<producer|worker>:<host>:<pid>"`` (default: this process). The segment
                is reclaimed early when that process dies (checked on this host only).
            detach: tie the segment to its TTL only, not to the owner's life. Use it when the
                writer may exit before a reader maps the segment (a CLI that submits and
                exits, a worker's result read later by a client).
            request_id: the request (task id) this segment is an input of: its TTL then
                counts from its last renewal, renewed while the request may still run (see
                :mod:`shared.transport.lifetime`). Send it in that request only.

        Returns:
            The :class:`TensorRef` to put in a message (``ref.to_dict()``).

        Raises:
            ShmCapacityError: the segment would take the store past ``capacity_bytes``, or
                the filesystem lacks space (checked before anything is written; ENOSPC
                during the write is also mapped to it and the partial file removed).
            InvalidInput: an unsupported type or dtype (bfloat16, complex, object, ...).
            ValueError: a non-positive ``ttl_s``, a malformed ``owner`` or ``request_id``.
            TransportError: any other I/O failure while writing.
        """
        arr = as_c_array(array)
        meta = self._describe(arr, ttl_s, owner, detach, request_id)
        ref = meta.ref()  # checked before anything is written
        enc = segment.encode(arr, meta)
        if self.recycle_bytes:
            self._kept.sweep()
        pool = self._pool if self.recycle_bytes else None
        res = writer.reserve(self._lock, pool, ref.id, enc.size, self._ensure_room)
        writer.write(res, enc, keep=pool is not None and enc.size >= MIN_RECYCLE_BYTES)
        self.kept_puts += res.kept is not None
        writer.publish(res, shm_root.segment_path(self.root, ref.id), self._kept)
        return ref

    def _describe(
        self,
        arr: np.ndarray,
        ttl_s: float | None,
        owner: str | None,
        detach: bool,
        request_id: str | None,
    ) -> segment.SegmentMeta:
        """The segment metadata of ``arr``, after checking :meth:`put`'s arguments."""
        ttl = self.default_ttl_s if ttl_s is None else float(ttl_s)
        if not (math.isfinite(ttl) and ttl > 0):
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        owner = self.default_owner if owner is None else owner
        if OWNER_PATTERN.fullmatch(owner) is None:
            raise ValueError(f"owner must be '<producer|worker>:<host>:<pid>', got {owner!r}")
        request = "" if request_id is None else validate_request_id(request_id)
        pid, pid_start = 0, None
        if not detach:
            pid = owner_pid(owner)
            # Only a process on this host can be probed; its start time pins the pid.
            pid_start = proc_start_time(pid) if owner_host(owner) == hostname() else None
        return segment.SegmentMeta(
            id=new_id(), shape=tuple(int(d) for d in arr.shape), dtype=arr.dtype.name,
            nbytes=int(arr.nbytes), owner=owner, pid=pid, pid_start=pid_start,
            created_at=time.time(), ttl_s=ttl,
            # Only files that can be pooled are rewritten: only they are worth a reader's cache.
            recycle=bool(self.recycle_bytes) and arr.nbytes >= MIN_RECYCLE_BYTES,
            request=request,
        )  # fmt: skip

    def _ensure_room(self, size: int) -> None:
        # Before refusing: drop recycled files, then reclaim expired and orphaned segments.
        shm_root.ensure_room(self.root, size, self.capacity_bytes, (self.trim_pool, self.gc))

    # -- read ------------------------------------------------------------------------------
    @_os_errors_as_transport_errors
    def get(self, ref: TensorRef | Mapping[str, Any]) -> np.ndarray:
        """A read-only numpy view (no copy) of the segment of ``ref`` (a :class:`TensorRef`
        or its wire dict): ``ref.shape`` and ``ref.dtype``, over the shared mapping. It stays
        valid after :meth:`release`; until it is collected it keeps the pages and the file's
        shared lock (a recycling store does not rewrite the file under it).

        Raises:
            TensorRefError: a malformed ref or id, an unknown/released/reclaimed segment, a
                file that is not a regular file of this uid, an expired segment, an extension
                type, or a file whose shape/dtype/nbytes/id differ from the ref's.
        """
        return self._reader.load(_coerce(ref), private=False)

    @_os_errors_as_transport_errors
    def get_torch(self, ref: TensorRef | Mapping[str, Any]) -> torch.Tensor:
        """A CPU torch tensor over the segment of ``ref``, without copying (torch is imported
        here, lazily).

        torch has no read-only tensors, and writing through a read-only mapping would kill the
        process (SIGSEGV): the file is mapped copy-on-write instead, so an in-place op copies
        only the pages it touches and the segment never changes (``torch.from_numpy``'s
        read-only warning is suppressed on purpose). Holds a descriptor and the file's shared
        lock while it lives; never served from the reader cache.

        Raises:
            TensorRefError: as :meth:`get`.
            ImportError: torch is not installed.
        """
        import torch

        arr = self._reader.load(_coerce(ref), private=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(arr)

    # -- delete, recycle -------------------------------------------------------------------
    @_os_errors_as_transport_errors
    def release(self, ref: TensorRef | Mapping[str, Any] | str) -> bool:
        """Delete the segment of ``ref`` (a :class:`TensorRef`, its wire dict or a bare id);
        idempotent. Readers that mapped it keep their views. A recycling store moves a file of
        at least 1 MiB into its pool instead, while the pool has room (:mod:`.pool`).

        Returns:
            True if a segment was removed, False if it was already gone.

        Raises:
            TensorRefError: a malformed ref or id, or a name that is not a regular file.
        """
        seg_id = ref if isinstance(ref, str) else _coerce(ref).id
        path = shm_root.segment_path(self.root, seg_id)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode):
            raise TensorRefError(f"tensor {seg_id}: not a regular file")
        if (
            self.recycle_bytes
            and st.st_size >= MIN_RECYCLE_BYTES
            and self._pool.give_back(path, st)
        ):
            return True
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        if self._kept:
            self._kept.sweep()
        return True

    @_os_errors_as_transport_errors
    def pool_bytes(self) -> int:
        """Bytes held by released files kept for reuse (0 unless recycling)."""
        return self._pool.bytes()

    @_os_errors_as_transport_errors
    def trim_pool(self, only_own: bool = False) -> list[str]:
        """Unlink pool files; returns their names. Mapped pages go with the last mapping.

        Args:
            only_own: only the files this store put into the pool (and nobody has claimed
                since), not other producers' (``FleetClient.close`` uses it).
        """
        return self._pool.trim(only_own)

    def kept_bytes(self) -> int:
        """Bytes of segment files this process keeps mapped for rewriting (recycling only)."""
        return self._kept.bytes()

    def close(self) -> None:
        """Drop every mapping this store keeps for rewriting (recycling) and every unpinned
        one its reader cache keeps; the files stay."""
        self._kept.close()
        if self.reader_cache is not None:
            self.reader_cache.close()

    # -- inventory -------------------------------------------------------------------------
    @_os_errors_as_transport_errors
    def info(self, seg_id: str) -> SegmentInfo:
        """One segment's metadata, from its file (not its data pages).

        Raises:
            TensorRefError: a malformed id, or a segment that is gone or unreadable.
        """
        return self._inventory.info(seg_id)

    @_os_errors_as_transport_errors
    def ls(self) -> list[SegmentInfo]:
        """The readable segments, oldest first. Unreadable files are skipped (see :meth:`gc`)."""
        return self._inventory.ls()

    @_os_errors_as_transport_errors
    def gc(self, now: float | None = None, finished: Collection[str] = ()) -> list[str]:
        """Reclaim what is stale at ``now`` (epoch seconds; default: the current time), and
        the segments bound to the requests of ``finished`` (known to be final), and return
        what went (see :meth:`.inventory.Inventory.gc`)."""
        removed = self._inventory.gc(now, finished)
        self._kept.sweep()
        return removed


def _coerce(ref: TensorRef | Mapping[str, Any]) -> TensorRef:
    return ref if isinstance(ref, TensorRef) else TensorRef.from_dict(ref)


def _check_settings(
    default_ttl_s: float,
    max_lifetime_s: float,
    capacity_fraction: float,
    capacity_bytes: int | None,
    role: str,
    recycle_bytes: int,
    recycle_idle_s: float,
    reader_cache_bytes: int,
) -> None:
    """ValueError naming the first of :class:`ShmStore`'s settings out of range."""
    if not (math.isfinite(default_ttl_s) and default_ttl_s > 0):
        raise ValueError(f"default_ttl_s must be > 0, got {default_ttl_s}")
    if not max_lifetime_s > 0:
        raise ValueError(f"max_lifetime_s must be > 0, got {max_lifetime_s}")
    if not 0 < capacity_fraction <= 1:
        raise ValueError(f"capacity_fraction must be in (0, 1], got {capacity_fraction}")
    if capacity_bytes is not None and capacity_bytes < 0:
        raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
    if role not in ("producer", "worker"):
        raise ValueError(f"role must be 'producer' or 'worker', got {role!r}")
    if recycle_bytes < 0 or not (math.isfinite(recycle_idle_s) and recycle_idle_s > 0):
        raise ValueError("recycle_bytes must be >= 0 and recycle_idle_s > 0")
    if reader_cache_bytes < 0:
        raise ValueError(f"reader_cache_bytes must be >= 0, got {reader_cache_bytes}")
