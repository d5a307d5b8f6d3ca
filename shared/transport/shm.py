"""Zero-copy tensor segments in ``/dev/shm``, one Arrow IPC file per tensor.

Layout::

    /dev/shm/mmfleet-<uid>/                 mode 0700, owned by this uid, never a symlink
        t<32 hex>.arrow                     a segment, mode 0600, immutable once visible
        .tmp-t<32 hex>-<pid>-<host>.arrow   a segment being written (renamed when complete)
        .pool-t<32 hex>.arrow               a released segment file kept for reuse (recycling
                                            stores only; its pages are already allocated)

Segment format: an Arrow IPC *file* (random-access format, uncompressed) holding one record
batch with one non-nullable column ``data``: the tensor's elements flattened in C order as a
primitive array of the tensor's dtype (``bool`` is stored as ``uint8``, one byte per element,
because Arrow's boolean type is bit-packed and could not be viewed without a copy). Buffers are
8-byte aligned by the IPC format, enough for every allowed dtype. The schema metadata carries
(all values UTF-8 strings)::

    mmfleet.format      "1"
    mmfleet.id          segment id (== the file name stem)
    mmfleet.shape       JSON list of ints, e.g. "[2, 3]"
    mmfleet.dtype       numpy dtype name
    mmfleet.nbytes      tensor size in bytes (prod(shape) * itemsize)
    mmfleet.owner       "<producer|worker>:<host>:<pid>"
    mmfleet.pid         pid whose death frees the segment; "0" = detached (TTL only)
    mmfleet.pid_start   that process's start time (/proc/<pid>/stat field 22) or "" --
                        guards against a recycled pid keeping an orphan alive
    mmfleet.created_at  Unix epoch seconds (float)
    mmfleet.ttl_s       seconds after created_at the segment may be reclaimed (float)
    mmfleet.recycle     "1" when written by a recycling store (its file will be rewritten)
    mmfleet.request     the request (task id) the segment was written for, or "": its TTL
                        then counts from its last renewal, the file's mtime (see
                        :mod:`shared.transport.lifetime`)

The janitor reads that metadata cheaply: mapping the file and parsing the IPC footer touches
only the footer's pages, never the tensor data.

Reading takes a shared ``flock`` on the file, maps it, parses the IPC file over the mapping
(``pyarrow.ipc.open_file`` on a ``py_buffer``) and returns a numpy array over the data bytes
of the mapping itself (``np.frombuffer`` at the data buffer's offset, then reshape); the
reader checks that the data buffer lies inside the mapping, so a compressed or otherwise
non-zero-copy file is refused rather than silently copied. A mapping stays valid after the
segment is released or reclaimed (tmpfs frees the pages when the last mapping goes), and it
holds the shared lock for as long as it lives (the lock belongs to the open file description,
which the mapping keeps). This module never truncates
or rewrites a published segment (it only unlinks), and new pages are only ever written through
``write()`` into a file reserved under a lock, never through a mapping: a full /dev/shm shows
up as ENOSPC (mapped to ``ShmCapacityError``), not as SIGBUS in a writer or a reader. (A
recycling store writes through a mapping only into pages that are allocated already; see
below.)

Recycling (``recycle_bytes > 0``: off by default in this class, on in the fleet's settings,
``[transport] recycle_bytes``): with 4 KiB tmpfs pages, allocating a segment's pages
costs more than copying into them (measured for 128 MiB: a put into fresh pages about 4
memcpys of the same bytes, into allocated ones about 2, and unlinking it 1.4). A recycling
store's :meth:`ShmStore.release` renames the released file to a pool name
(``.pool-<random>``) instead of unlinking it, up to ``recycle_bytes`` in all; a later
:meth:`ShmStore.put` claims the pool file closest in size (at least as large and at most
twice as large, else at most 64 KiB smaller; a segment under about 1 MiB claims none),
truncates it to the exact size and writes the new segment into its
allocated pages, under a new random id. A pool file is reused only when no reader has a live
view of it: after the rename no process can open it by id any more, and the claim takes an
exclusive ``flock`` without waiting, which every reader's shared lock denies (a reader locks
before it maps, and keeps the lock as long as any view of the file lives); the claim holds the
lock until the new segment is written, and a file it cannot lock is unlinked instead (its
pages go when the last mapping does). So a view returned by :meth:`ShmStore.get` never sees
another tensor's data. (A write lease, ``F_SETLEASE``, proved the same until a reader could
keep a mapping without a view: see the reader cache below. Locks are advisory: a process that
maps segment files without this class is not protected.) Pool files are counted in the capacity
budget, dropped first when a put needs room, and reclaimed by :meth:`ShmStore.gc` once idle
for ``recycle_idle_s`` (:meth:`ShmStore.trim_pool` drops them all).

A recycling store also keeps a writable mapping of each file it writes (at most
``recycle_bytes`` of them); when it claims such a file again for a segment of exactly its size
(one shape from one process: the metadata is fixed-width), it writes through that mapping,
whose pages are faulted in already: one memcpy (128 MiB here: 11.7 ms, against 25-29 ms
through ``write()`` into a recycled file and 65-70 into a fresh one). The claim's lock is then
taken on the mapping's own file description, and the file's size is checked under it (another
process may have claimed and resized the file meanwhile). Mappings of files that are gone
(unlinked by :meth:`ShmStore.gc` in any process) are dropped at the next put, release or gc;
:meth:`ShmStore.close` drops them all.

The reader cache (``reader_cache_bytes > 0``, :mod:`shared.transport.mapcache`): a reader
that keeps its mapping of a file a recycling store wrote (flagged ``mmfleet.recycle`` in the
metadata) reads the next segment written into the same file without faulting its pages into
its page tables again (128 MiB here: 8-13 ms of the read). The cached mapping holds the
shared lock only while a view of it lives, so the producer can claim the file in between.

Capacity: puts are serialised by an ``flock`` on the root while the budget is checked and the
temp file is sized (``ftruncate`` to the exact IPC size), so concurrent processes cannot
overshoot ``capacity_bytes``; the data is written after the lock is released.

Security: pyarrow >= 14.0.1 is required (CVE-2023-47248: arbitrary code execution when
reading IPC data with the legacy ``arrow.py_extension_type``); in addition every extension
type, registered or not, is refused. Ids are validated against a strict pattern and file
names are built from the id alone; files must be regular files owned by this uid.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import logging
import math
import mmap
import os
import re
import socket
import stat
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.ipc

from shared.errors import ShmCapacityError, TensorRefError, TransportError
from shared.procs import pid_alive, proc_start_time
from shared.transport._arrays import as_c_array
from shared.transport.lifetime import expires_at as lease_expires_at
from shared.transport.lifetime import validate_request_id
from shared.transport.mapcache import (
    MappingCache,
    Sweeper,
    lock_exclusive,
    lock_shared,
    unlock,
    unmap_and_close,
)
from shared.transport.ref import (
    DTYPE_ITEMSIZE,
    OWNER_PATTERN,
    TensorRef,
    new_id,
    numel,
    owner_host,
    owner_pid,
    validate_id,
)

if TYPE_CHECKING:
    import torch

MIN_PYARROW: tuple[int, int, int] = (14, 0, 1)


def _version_tuple(version: str) -> tuple[int, int, int] | None:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


_pa_version = _version_tuple(pa.__version__)
if _pa_version is None or _pa_version < MIN_PYARROW:
    raise ImportError(
        f"shared.transport needs pyarrow >= {'.'.join(map(str, MIN_PYARROW))} "
        f"(CVE-2023-47248, code execution through IPC extension types); found "
        f"{pa.__version__}. Upgrade: pip install 'pyarrow>=14.0.1'"
    )

log = logging.getLogger(__name__)

SEGMENT_SUFFIX = ".arrow"
COLUMN = "data"
FORMAT_VERSION = "1"
_META = "mmfleet."
_SEGMENT_RE = re.compile(r"(t[0-9a-f]{32})\.arrow")
_TMP_RE = re.compile(r"\.tmp-(t[0-9a-f]{32})-([0-9]{1,10})-([A-Za-z0-9._-]{1,64})\.arrow")
_POOL_RE = re.compile(r"\.pool-(t[0-9a-f]{32})\.arrow")
_MIN_RECYCLE_BYTES = 1 << 20  # smaller files are cheap to allocate: unlinked, never pooled
# A pool file this much smaller than a new segment still serves it (the rest is allocated by
# the write): two tensors of one shape differ by a few bytes of metadata (times, ids, pids).
_RECYCLE_SLACK_BYTES = 64 << 10
_MIN_SHM_WARN_BYTES = 256 * 1024 * 1024
# Out of descriptors or memory: the process's trouble, not the ref's.
_RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)

# Arrow storage type of each allowed dtype. bool -> uint8: see the module docstring.
_ARROW_TYPES: dict[str, pa.DataType] = {
    "bool": pa.uint8(),
    "uint8": pa.uint8(),
    "int8": pa.int8(),
    "int16": pa.int16(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float16": pa.float16(),
    "float32": pa.float32(),
    "float64": pa.float64(),
}


def default_root() -> Path:
    """The fleet directory of this uid: ``/dev/shm/mmfleet-<uid>``."""
    return Path(f"/dev/shm/mmfleet-{os.getuid()}")


@cache
def hostname() -> str:
    """This host's name reduced to ``[A-Za-z0-9._-]`` (at most 64 chars), as used in owners."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64]
    return name or "localhost"


@dataclass(frozen=True)
class SegmentInfo:
    """One segment as the janitor sees it (from the file's schema metadata).

    Sizes in bytes, times in Unix epoch seconds. ``pid`` is 0 for a detached segment.
    ``alive_owner`` is True when the owner process is alive, the segment is detached, or
    the owner is on another host (liveness cannot be checked from here). ``request``: the
    request it is bound to, or ""; ``expires_at`` counts its renewals (see
    :mod:`shared.transport.lifetime`).
    """

    id: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    file_bytes: int
    owner: str
    pid: int
    created_at: float
    expires_at: float
    alive_owner: bool
    ttl_s: float = 0.0
    request: str = ""


@dataclass(frozen=True)
class _Meta:
    id: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    owner: str
    pid: int
    pid_start: int | None
    created_at: float
    ttl_s: float
    recycle: bool = False  # written by a recycling store: its file will be rewritten
    request: str = ""  # the request it was written for ("": none)

    @property
    def expires_at(self) -> float:
        return self.created_at + self.ttl_s

    def leased_until(self, renewed_at: float, max_lifetime_s: float) -> float:
        """Its expiry, counting renewals (``renewed_at``: the file's mtime)."""
        return lease_expires_at(
            self.created_at, self.ttl_s, renewed_at, max_lifetime_s, bool(self.request)
        )

    def to_metadata(self) -> dict[str, str]:
        return {
            _META + "format": FORMAT_VERSION,
            _META + "id": self.id,
            _META + "shape": json.dumps(list(self.shape)),
            _META + "dtype": self.dtype,
            _META + "nbytes": str(self.nbytes),
            _META + "owner": self.owner,
            _META + "pid": str(self.pid),
            _META + "pid_start": "" if self.pid_start is None else str(self.pid_start),
            # Fixed width (epoch seconds, microseconds): segments of one shape written by one
            # process have the same size, so a kept mapping fits them (see _Kept).
            _META + "created_at": f"{self.created_at:.6f}",
            _META + "ttl_s": repr(self.ttl_s),
            _META + "recycle": "1" if self.recycle else "0",
            _META + "request": self.request,
        }

    @classmethod
    def from_schema(cls, schema: pa.Schema, seg_id: str) -> _Meta:
        """Parse and cross-check the metadata; TensorRefError when anything is off."""
        raw = schema.metadata or {}
        try:
            md = {k.decode(): v.decode() for k, v in raw.items() if k.startswith(b"mmfleet.")}
            if md.get(_META + "format") != FORMAT_VERSION:
                raise ValueError(f"format {md.get(_META + 'format')!r}")
            shape = json.loads(md[_META + "shape"])
            if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
                raise ValueError("shape")
            pid_start = md[_META + "pid_start"]
            meta = cls(
                id=md[_META + "id"],
                shape=tuple(shape),
                dtype=md[_META + "dtype"],
                nbytes=int(md[_META + "nbytes"]),
                owner=md[_META + "owner"],
                pid=int(md[_META + "pid"]),
                pid_start=int(pid_start) if pid_start else None,
                created_at=float(md[_META + "created_at"]),
                ttl_s=float(md[_META + "ttl_s"]),
                recycle=md.get(_META + "recycle", "0") == "1",
                request=md.get(_META + "request", ""),
            )
            if meta.request:
                validate_request_id(meta.request)
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            raise TensorRefError(f"segment {seg_id}: bad metadata ({exc})") from None
        if meta.id != seg_id:
            raise TensorRefError(f"segment {seg_id}: metadata names another id")
        if meta.dtype not in DTYPE_ITEMSIZE:
            raise TensorRefError(f"segment {seg_id}: dtype {meta.dtype[:20]!r} not allowed")
        if meta.nbytes != numel(meta.shape) * DTYPE_ITEMSIZE[meta.dtype]:
            raise TensorRefError(f"segment {seg_id}: nbytes does not match shape and dtype")
        if OWNER_PATTERN.fullmatch(meta.owner) is None or meta.pid < 0:
            raise TensorRefError(f"segment {seg_id}: bad owner")
        if not (math.isfinite(meta.created_at) and math.isfinite(meta.ttl_s)):
            raise TensorRefError(f"segment {seg_id}: bad times")
        return meta


@dataclass
class _Kept:
    """A writable shared mapping of a segment file this process wrote, kept after the write.

    Writing a segment into a recycled file through ``write()`` costs about two memcpys of its
    bytes (the kernel looks up and copies into each 4 KiB page); through a mapping that is
    already faulted in, one. A recycling store therefore keeps the mapping (and the open file
    description it came from) of each file it writes; when it claims that file again from
    the pool for a segment of exactly its size, it writes through the mapping. The claim's
    exclusive lock is taken on this description, and the file's size is compared with
    ``size`` under it (a claim in another process may have resized the file while this
    mapping was idle), so the write never reaches an unallocated page: no SIGBUS.
    """

    fd: int
    mm: mmap.mmap
    size: int
    closed: bool = False

    def close(self) -> None:
        """Unmap and close the descriptor, once (a second close could hit a reused fd)."""
        if not self.closed:
            self.closed = True
            unmap_and_close(self.mm, self.fd)

    def detach(self) -> int:
        """Unmap, and hand the descriptor (with any lock on it) to the caller."""
        self.closed = True
        with suppress(BufferError):
            self.mm.close()
        return self.fd

    def __del__(self) -> None:
        # A store dropped without close() must not leak the descriptor.
        with suppress(OSError):
            self.close()


def _refuse_extension_types(schema: pa.Schema, seg_id: str) -> None:
    """TensorRefError if any field has an Arrow extension type, registered or not."""
    for field in schema:
        fmeta = field.metadata or {}
        # A registered extension type deserialises to an ExtensionType instance; an
        # unregistered one to its storage type plus ARROW:extension:* field metadata.
        if isinstance(field.type, pa.BaseExtensionType) or any(
            k.startswith(b"ARROW:extension") for k in fmeta
        ):
            raise TensorRefError(f"segment {seg_id}: Arrow extension types are refused")


def _check_column(schema: pa.Schema, seg_id: str, dtype: str) -> None:
    """TensorRefError unless the schema is one ``data`` column of ``dtype``'s storage type."""
    if len(schema) != 1 or schema[0].name != COLUMN:
        raise TensorRefError(f"segment {seg_id}: expected exactly one column {COLUMN!r}")
    if schema[0].type != _ARROW_TYPES[dtype]:
        raise TensorRefError(
            f"segment {seg_id}: column type {schema[0].type} does not store dtype {dtype}"
        )


def _ipc_file_size(schema: pa.Schema, batch: pa.RecordBatch) -> int:
    """Exact size in bytes of the IPC file for ``batch``, computed without copying data."""
    sink = pa.MockOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)
    return int(sink.size())


def _write_ipc_mapped(kept: _Kept, schema: pa.Schema, batch: pa.RecordBatch) -> None:
    """Write ``batch`` as an IPC file into a kept mapping of exactly its size."""
    sink = pa.FixedSizeBufferWriter(pa.py_buffer(kept.mm))
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)
    if sink.tell() != kept.size:
        raise OSError(f"segment wrote {sink.tell()} bytes into a {kept.size}-byte file")


def _write_ipc(sink: BinaryIO, schema: pa.Schema, batch: pa.RecordBatch) -> None:
    """Write ``batch`` as an IPC file to ``sink`` (a seam for tests that simulate ENOSPC)."""
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)


_stores: weakref.WeakSet[ShmStore] = weakref.WeakSet()
_root_fd_guard = threading.Lock()  # see ShmStore._lock


def _stores_after_fork_in_child() -> None:
    _root_fd_guard.release()  # taken by the forking thread, which goes on in the child
    # A lock held by a parent's thread at the fork would never be released in the child.
    for store in list(_stores):
        store._kept_lock = threading.RLock()
        store._kept_sweeper.reset_after_fork(store._kept_lock)
        store._own_pool = set()  # the parent's pool files are not the child's to trim
        for fd in list(store._root_lock_fds):
            # Another thread of the parent held the root lock: closing the child's copy
            # leaves the lock to the parent (which drops it when its own copy closes).
            with suppress(OSError):
                os.close(fd)
        store._root_lock_fds = set()


os.register_at_fork(
    before=_root_fd_guard.acquire,
    after_in_parent=_root_fd_guard.release,
    after_in_child=_stores_after_fork_in_child,
)


_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")


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


def _reclaimed(seg_id: str) -> TensorRefError:
    """The error of a read that found the segment's file being rewritten as another one."""
    return TensorRefError(f"unknown tensor {seg_id}: released and reclaimed")


def _unlink_quiet(path: Path) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - loop always returns


class ShmStore:
    """Write tensors once into shared memory; map them anywhere on the host without copying.

    Args:
        root: the fleet directory (default :func:`default_root`). Created with mode 0700 if
            missing; an existing one must be a real directory (not a symlink), owned by this
            uid, with mode exactly 0700.
        capacity_bytes: budget for all segments in ``root`` together, in bytes (file sizes,
            temp files included). Default: ``capacity_fraction`` of the filesystem's size.
        default_ttl_s: lifetime of a segment when :meth:`put` is given none, in seconds.
        capacity_fraction: fraction of the filesystem used when ``capacity_bytes`` is None.
        role: ``"producer"`` or ``"worker"``, the first part of the default owner string.
        recycle_bytes: keep released segment files of at least 1 MiB, up to this many bytes
            in all, and write later segments into them (see "Recycling" in the module
            docstring). 0 (the default): released segments are unlinked at once.
        recycle_idle_s: :meth:`gc` unlinks pool files unused for this long, in seconds.
        reader_cache_bytes: keep this store's read mappings of segments written by a
            recycling store, up to this many bytes, so that the next segment written into the
            same file is read through page tables that are ready (see
            :mod:`shared.transport.mapcache`). 0 (the default): every view has its own
            mapping, unmapped when the view goes.
        max_lifetime_s: renewals of a segment bound to a request never keep it past its
            write time plus this, in seconds (see :mod:`shared.transport.lifetime`).

    Raises:
        TransportError: the parent directory is missing (no /dev/shm: use the inline
            transport), or ``root`` is a symlink, not a directory, owned by another uid or
            not mode 0700.
        ValueError: a non-positive TTL, lifetime or fraction, or a negative capacity, recycle
            or reader cache budget.

    Besides its settings, the store keeps only the mappings of a recycling store (see the
    module docstring), which a forked child drops at its first put; so one instance may be
    created before a fork and used in the children (the owner pid is read at each put).
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
        self.recycle_bytes = int(recycle_bytes)
        self.recycle_idle_s = float(recycle_idle_s)
        self.root = Path(root) if root is not None else default_root()
        self.default_ttl_s = float(default_ttl_s)
        self.max_lifetime_s = float(max_lifetime_s)
        self.role = role
        self._uid = os.getuid()
        self._open_root()
        if capacity_bytes is None:
            capacity_bytes = int(self.fs_total_bytes() * capacity_fraction)
        self.capacity_bytes = int(capacity_bytes)
        # Mappings of files this process wrote, by (st_dev, st_ino); see _Kept.
        self._kept: dict[tuple[int, int], _Kept] = {}
        self._kept_pid = os.getpid()
        # The worker's janitor thread runs gc() on the store the inference threads put to.
        self._kept_lock = threading.RLock()
        self._kept_sweeper = Sweeper(
            self._sweep_kept_tick, 1.0, self._kept_lock, "shm-kept-sweeper"
        )
        self._own_pool: set[str] = set()  # pool names this store created (see trim_pool)
        self._root_lock_fds: set[int] = set()  # descriptors holding the root lock (_lock)
        _stores.add(self)
        self.kept_puts = 0  # puts written through a kept mapping (one memcpy)
        self.reader_cache = MappingCache(reader_cache_bytes) if reader_cache_bytes else None

    # -- the directory ---------------------------------------------------------------------
    @_os_errors_as_transport_errors
    def _open_root(self) -> None:
        created = False
        try:
            os.mkdir(self.root, 0o700)
            created = True
        except FileExistsError:
            pass
        except FileNotFoundError:
            raise TransportError(
                f"cannot create {self.root}: {self.root.parent} does not exist "
                "(no shared /dev/shm on this host? use the inline transport)"
            ) from None
        if self.root.is_symlink():  # checked first for a clear message; O_NOFOLLOW below
            raise TransportError(f"refusing shm root {self.root}: it is a symlink")
        # O_NOFOLLOW + fstat/fchmod on the descriptor: no window in which a symlink swapped
        # in after the check could redirect the chmod.
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            what = "a symlink" if exc.errno == errno.ELOOP else "not a directory"
            raise TransportError(f"refusing shm root {self.root}: {what} ({exc})") from None
        try:
            st = os.fstat(fd)
            if st.st_uid != self._uid:
                raise TransportError(
                    f"refusing shm root {self.root}: owned by uid {st.st_uid}, not {self._uid}"
                )
            mode = stat.S_IMODE(st.st_mode)
            if created and mode != 0o700:
                os.fchmod(fd, 0o700)  # the umask may have removed owner bits at mkdir
            elif mode != 0o700:
                raise TransportError(
                    f"refusing shm root {self.root}: mode {mode:04o}, expected 0700 "
                    f"(fix: chmod 700 {self.root})"
                )
        finally:
            os.close(fd)

    @contextmanager
    def _lock(self) -> Iterator[None]:
        """Exclusive flock on the root, serialising capacity checks across processes.

        A fresh descriptor per call: flock locks belong to the open file description, which a
        forked child would otherwise share with its parent (and so not exclude it).
        """
        # A child forked while another thread holds the lock would keep it with its copy of
        # the descriptor (and wait on itself at its first put): the fork hook closes the
        # child's copies. The guard keeps a fork out of the windows where a descriptor is
        # open but not (or no longer) registered.
        with _root_fd_guard:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            self._root_lock_fds.add(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            with _root_fd_guard:
                self._root_lock_fds.discard(fd)
                os.close(fd)  # closing releases the lock

    def _path(self, seg_id: str) -> Path:
        return self.root / f"{validate_id(seg_id)}{SEGMENT_SUFFIX}"

    @property
    def default_owner(self) -> str:
        """``"<role>:<host>:<pid>"`` of the calling process."""
        return f"{self.role}:{hostname()}:{os.getpid()}"

    # -- capacity --------------------------------------------------------------------------
    def fs_total_bytes(self) -> int:
        """Size of the filesystem holding ``root`` (``/dev/shm``), in bytes."""
        st = os.statvfs(self.root)
        return st.f_blocks * st.f_frsize

    def fs_free_bytes(self) -> int:
        """Bytes still available on the filesystem holding ``root``."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    @_os_errors_as_transport_errors
    def used_bytes(self) -> int:
        """Bytes held by this store's files: segments, in-progress temp files and pool files.

        File sizes, each inode once (a segment is briefly linked under two names while it is
        published). Released segments still mapped by a reader are not counted, although tmpfs
        keeps their pages until the last mapping goes.
        """
        total = 0
        seen: set[int] = set()
        with os.scandir(self.root) as it:
            for entry in it:
                if not (
                    _SEGMENT_RE.fullmatch(entry.name)
                    or _TMP_RE.fullmatch(entry.name)
                    or _POOL_RE.fullmatch(entry.name)
                ):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_size
        return total

    @_os_errors_as_transport_errors
    def check_capacity(self, min_bytes: int = _MIN_SHM_WARN_BYTES) -> str | None:
        """A warning for the startup log when /dev/shm cannot hold what the budget promises.

        Args:
            min_bytes: warn when the budget is below this many bytes (default 256 MiB: a
                container left at Docker's 64 MB default ``shm_size`` is caught here).

        Returns:
            None when all is well, else a message naming the sizes and the fix.
        """
        total, free, used = self.fs_total_bytes(), self.fs_free_bytes(), self.used_bytes()
        problems = []
        if total < self.capacity_bytes:
            problems.append(
                f"{self.root.parent} holds {_fmt_bytes(total)}, less than the transport "
                f"budget of {_fmt_bytes(self.capacity_bytes)}"
            )
        elif free + used < self.capacity_bytes:
            problems.append(
                f"only {_fmt_bytes(free)} free in {self.root.parent} (other users hold the "
                f"rest), less than the unused budget of {_fmt_bytes(self.capacity_bytes - used)}"
            )
        if self.capacity_bytes < min_bytes:
            problems.append(
                f"the transport budget is only {_fmt_bytes(self.capacity_bytes)} "
                f"(< {_fmt_bytes(min_bytes)})"
            )
        if not problems:
            return None
        enlarge = (
            f"enlarge {self.root.parent} (docker run --shm-size, compose shm_size, a larger tmpfs)"
        )
        fixes = []
        if total < self.capacity_bytes or free + used < self.capacity_bytes:
            fixes.append(f"{enlarge} or lower the budget to what it holds")
        if self.capacity_bytes < min_bytes:
            fixes.append(
                enlarge
                if total < min_bytes
                else "raise the budget ([transport] capacity_bytes or capacity_fraction)"
            )
        return (
            "shared-memory transport: "
            + "; ".join(problems)
            + ". Large tensors will be refused with SHM_CAPACITY. Fix: "
            + "; ".join(fixes)
            + "."
        )

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
            owner: ``"<producer|worker>:<host>:<pid>"`` (default: this process). The
                segment is reclaimed early when that process dies (checked on this host
                only).
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
        ttl = self.default_ttl_s if ttl_s is None else float(ttl_s)
        if not (math.isfinite(ttl) and ttl > 0):
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        owner = self.default_owner if owner is None else owner
        if OWNER_PATTERN.fullmatch(owner) is None:
            raise ValueError(f"owner must be '<producer|worker>:<host>:<pid>', got {owner!r}")
        request = "" if request_id is None else validate_request_id(request_id)
        if detach:
            pid, pid_start = 0, None
        else:
            pid = owner_pid(owner)
            # Only a process on this host can be probed; its start time pins the pid.
            pid_start = proc_start_time(pid) if owner_host(owner) == hostname() else None
        ref = TensorRef(
            id=new_id(),
            shape=tuple(int(d) for d in arr.shape),
            dtype=arr.dtype.name,
            nbytes=int(arr.nbytes),
            owner=owner,
            created_at=time.time(),
            ttl_s=ttl,
        )
        meta = _Meta(
            id=ref.id,
            shape=ref.shape,
            dtype=ref.dtype,
            nbytes=ref.nbytes,
            owner=owner,
            pid=pid,
            pid_start=pid_start,
            created_at=ref.created_at,
            ttl_s=ttl,
            # Only files that can be pooled are rewritten: only they are worth a reader's cache.
            recycle=bool(self.recycle_bytes) and arr.nbytes >= _MIN_RECYCLE_BYTES,
            request=request,
        )
        arrow_type = _ARROW_TYPES[ref.dtype]
        schema = pa.schema(
            [pa.field(COLUMN, arrow_type, nullable=False)], metadata=meta.to_metadata()
        )
        flat = arr.reshape(-1)
        if ref.dtype == "bool":
            flat = flat.view(np.uint8)
        # from_buffers wraps the array's memory: the only copy is the write into the file.
        column = pa.Array.from_buffers(arrow_type, flat.size, [None, pa.py_buffer(flat)])
        batch = pa.record_batch([column], schema=schema)
        size = _ipc_file_size(schema, batch)

        final = self._path(ref.id)
        tmp = self.root / f".tmp-{ref.id}-{os.getpid()}-{hostname()}{SEGMENT_SUFFIX}"
        if self.recycle_bytes:
            self._sweep_kept()
        kept: _Kept | None = None
        with self._lock():
            # A pool file of about ``size``: its pages are allocated already; only what it
            # lacks (if anything) is new to the budget.
            claimed = self._claim_pooled(size, tmp) if self.recycle_bytes else None
            if claimed is None:
                self._reserve_check(size)
                # O_RDWR: a recycling store keeps a shared writable mapping of it afterwards.
                fd = os.open(
                    tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
                )
            else:
                fd, have, kept = claimed
                try:
                    # The claimed file is in the budget already (pool files count), but it
                    # may have been pooled by a store with a larger budget: check anyway.
                    self._reserve_check(max(0, size - have))
                except BaseException:
                    if kept is not None:
                        kept.close()  # its descriptor is fd: closed once, here
                    else:
                        os.close(fd)
                    _unlink_quiet(tmp)
                    raise
            if kept is None:
                try:
                    os.fchmod(fd, 0o600)  # exact mode whatever the umask
                    # Sized (sparse) at once so that concurrent puts count it in used_bytes()
                    # while the data is still being written outside the lock.
                    os.ftruncate(fd, size)
                except BaseException:
                    os.close(fd)
                    _unlink_quiet(tmp)
                    raise
        keep_fd: int | None = None
        try:
            if kept is not None:
                _write_ipc_mapped(kept, schema, batch)
                self.kept_puts += 1
                # The claim's exclusive lock (see _claim_pooled) ends with the write, before
                # the segment is published (no reader can open the temp name meanwhile).
                unlock(kept.fd)
            else:
                try:
                    # A claimed file's description may be one this store kept, its offset
                    # at the end of an earlier write: the IPC file starts at byte 0.
                    os.lseek(fd, 0, os.SEEK_SET)
                    if self.recycle_bytes and size >= _MIN_RECYCLE_BYTES:
                        keep_fd = os.dup(fd)  # the same description, kept with a mapping
                    f = os.fdopen(fd, "wb")  # buffered: write() loops over short writes
                except BaseException:
                    os.close(fd)
                    raise
                with f:
                    _write_ipc(f, schema, batch)
                    f.flush()
                    written = f.tell()
                    if written != size:  # never expected; keep the footer at the file's end
                        os.ftruncate(f.fileno(), written)
                        size = written
                    if claimed is not None:
                        # Explicitly, not by the close: a child forked meanwhile holds a
                        # copy of this description, and with it the lock, until it exits.
                        unlock(f.fileno())
            # link (not rename): fails with EEXIST instead of replacing an existing segment,
            # and the segment appears complete or not at all.
            os.link(tmp, final)
        except BaseException as exc:
            if kept is not None:
                kept.close()
            if keep_fd is not None:
                os.close(keep_fd)
            _unlink_quiet(tmp)
            if _is_enospc(exc):
                raise ShmCapacityError(
                    f"no space left in {self.root.parent} while writing "
                    f"{_fmt_bytes(size)}; nothing was kept"
                ) from None
            if isinstance(exc, OSError):
                raise TransportError(f"writing segment {ref.id} failed: {exc}") from exc
            raise
        _unlink_quiet(tmp)
        if kept is not None:
            self._remember(kept)
        elif keep_fd is not None:
            self._keep(keep_fd, size)
        return ref

    def _reserve_check(self, size: int) -> None:
        """Raise ShmCapacityError unless ``size`` more bytes fit (caller holds the lock)."""
        used = self.used_bytes()
        # Before refusing: drop recycled files, then reclaim expired and orphaned segments.
        for reclaim in (self.trim_pool, self.gc):
            if used + size > self.capacity_bytes and reclaim():
                used = self.used_bytes()
        if used + size > self.capacity_bytes:
            raise ShmCapacityError(
                f"shared-memory budget exceeded: {_fmt_bytes(size)} requested, "
                f"{_fmt_bytes(used)} of {_fmt_bytes(self.capacity_bytes)} in use"
            )
        free = self.fs_free_bytes()
        if size > free:
            raise ShmCapacityError(
                f"{self.root.parent} has {_fmt_bytes(free)} free, {_fmt_bytes(size)} requested"
            )

    # -- read ------------------------------------------------------------------------------
    def get(self, ref: TensorRef | Mapping[str, Any]) -> np.ndarray:
        """Map a segment and return a read-only numpy view of it (no copy).

        Args:
            ref: a :class:`TensorRef` or its wire dict.

        Returns:
            An array of ``ref.shape`` and ``ref.dtype`` whose memory is the shared mapping
            (``writeable`` is False; writing raises ValueError). It stays valid after
            :meth:`release` and keeps the pages alive until it is garbage-collected; until
            then it also holds the file's shared lock, so a recycling store does not rewrite
            the file under it. Views of a segment a recycling store wrote come from this
            store's reader cache, when it has one (``reader_cache_bytes``).

        Raises:
            TensorRefError: a malformed ref or id, an unknown/released/reclaimed segment, a
                file that is not a regular file of this uid, an expired segment, an extension
                type, or a file whose shape/dtype/nbytes/id differ from the ref's.
        """
        return self._load(self._coerce(ref), private=False)

    def get_torch(self, ref: TensorRef | Mapping[str, Any]) -> torch.Tensor:
        """Map a segment and return a CPU torch tensor over it, without copying the data.

        torch is imported here, lazily. ``torch.from_numpy`` warns on read-only arrays
        because torch has no read-only tensors and writing through a read-only (PROT_READ)
        mapping would kill the process with SIGSEGV. So this maps the file copy-on-write
        (``MAP_PRIVATE``) instead: the tensor is zero-copy until written, an in-place op is
        safe and copies only the pages it touches into this process, and the shared segment
        is never modified. The warning is therefore suppressed on purpose. One file
        descriptor stays open per live tensor (Python's ``mmap`` keeps one), and with it the
        file's shared lock (see :meth:`get`). Never served from the reader cache.

        Raises:
            TensorRefError: as :meth:`get`.
            ImportError: torch is not installed.
        """
        import torch

        arr = self._load(self._coerce(ref), private=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(arr)

    @staticmethod
    def _coerce(ref: TensorRef | Mapping[str, Any]) -> TensorRef:
        return ref if isinstance(ref, TensorRef) else TensorRef.from_dict(ref)

    def _open_segment(self, seg_id: str) -> int:
        """An O_RDONLY descriptor of a segment that is a regular file owned by this uid."""
        path = self._path(seg_id)
        try:
            fd = self._with_descriptors(
                lambda: os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            )
        except FileNotFoundError:
            raise TensorRefError(
                f"unknown tensor {seg_id}: released, reclaimed, or written on another host"
            ) from None
        except OSError as exc:
            if exc.errno in _RESOURCE_ERRNOS:
                raise TransportError(f"cannot open tensor {seg_id}: {exc.strerror}") from None
            # ELOOP: a symlink; EISDIR etc.
            raise TensorRefError(f"tensor {seg_id}: not a regular file ({exc.strerror})") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != self._uid or st.st_size == 0:
            os.close(fd)
            raise TensorRefError(f"tensor {seg_id}: not a non-empty regular file of this user")
        return fd

    def _with_descriptors(self, call: Callable[[], _T]) -> _T:
        """``call()``; when the process is out of descriptors, once more after the reader
        cache gave back those of the mappings no view uses."""
        try:
            return call()
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            if self.reader_cache is None or not self.reader_cache.drop_unpinned():
                raise
        return call()

    def _lock_for_reading(self, fd: int, seg_id: str) -> int:
        """Take the shared lock every reader holds while it maps a segment (see
        :meth:`_claim_pooled`); returns the file's size, read under the lock.

        Raises:
            TensorRefError: a producer holds the exclusive lock: the file is being rewritten
                as another segment, so this one was released.
        """
        if not lock_shared(fd):
            raise _reclaimed(seg_id)
        size = os.fstat(fd).st_size
        if size == 0:
            raise TensorRefError(f"tensor {seg_id}: not a non-empty regular file of this user")
        return size

    @_os_errors_as_transport_errors
    def _load(self, ref: TensorRef, *, private: bool) -> np.ndarray:
        """Map ``ref``'s segment (or find it in the reader cache), check it, and return the
        zero-copy view. The view holds the segment's shared lock until it is collected: a
        plain mapping through its own open file description (the lock goes with the
        mapping), a cached one through a pin (see :mod:`shared.transport.mapcache`)."""
        fd = self._open_segment(ref.id)
        cache = None if private else self.reader_cache
        entry = None
        try:
            if cache is not None:
                try:
                    entry = cache.pin(fd)
                except BlockingIOError:
                    raise _reclaimed(ref.id) from None
            if entry is not None:
                mm, size = entry.mm, entry.size
            else:
                size = self._lock_for_reading(fd, ref.id)
                # Copy-on-write when private: see get_torch.
                flags, prot = (
                    (mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
                    if private
                    else (mmap.MAP_SHARED, mmap.PROT_READ)
                )
                try:
                    mm = self._with_descriptors(lambda: mmap.mmap(fd, size, flags=flags, prot=prot))
                except OSError as exc:  # EMFILE (Python's mmap dups fd), ENOMEM
                    raise TransportError(f"cannot map tensor {ref.id}: {exc}") from None
            failure: str | None = None
            try:
                arr, meta = self._view(ref, mm, size, os.fstat(fd).st_mtime)
            except TensorRefError as exc:
                failure = exc.message
            if failure is not None:
                # Raised afresh, outside the except block: the caught exception's traceback
                # holds frames that hold Arrow buffers over the mapping, and a caller that
                # keeps the exception (Celery does, in a reference cycle) would keep the
                # mapping, its tmpfs pages and its shared lock alive until a GC pass. Here
                # nothing exports the mapping any more: unmap it now.
                if entry is None:
                    with suppress(BufferError):
                        mm.close()
                raise TensorRefError(failure)
            if entry is None and cache is not None and meta.recycle:
                # A recycling producer will rewrite this file: keep the mapping (and our
                # descriptor, with its shared lock) for the next segment written into it.
                entry = cache.adopt(fd, mm, size)
                if entry is not None:
                    fd = -1
            if entry is not None:
                cache.attach(entry, arr)  # type: ignore[union-attr]
                entry = None  # the view owns the pin now
        finally:
            if entry is not None:
                cache.unpin(entry)  # type: ignore[union-attr]
            if fd >= 0:
                # Python's mmap holds a dup of fd: the same description, so the shared lock
                # stays until the mapping is gone.
                os.close(fd)
        if ref.dtype == "bool":
            arr = arr.view(np.bool_)
        return arr.reshape(ref.shape)

    def _view(
        self, ref: TensorRef, mm: mmap.mmap, size: int, renewed_at: float
    ) -> tuple[np.ndarray, _Meta]:
        """The flat data array of the IPC file in ``mm`` (no copy), after every check
        (``renewed_at``: the file's mtime, the last renewal of a segment bound to a request)."""
        buf = pa.py_buffer(mm)
        try:
            reader = pa.ipc.open_file(buf)
            schema = reader.schema
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise TensorRefError(f"tensor {ref.id}: not a valid Arrow IPC file ({exc})") from None
        _refuse_extension_types(schema, ref.id)
        meta = _Meta.from_schema(schema, ref.id)
        if (meta.shape, meta.dtype, meta.nbytes) != (ref.shape, ref.dtype, ref.nbytes):
            raise TensorRefError(
                f"tensor {ref.id}: ref says {list(ref.shape)} {ref.dtype} {ref.nbytes} B, "
                f"segment holds {list(meta.shape)} {meta.dtype} {meta.nbytes} B"
            )
        _check_column(schema, ref.id, ref.dtype)
        # The file's times are authoritative: a forged ref cannot extend a segment's life.
        if time.time() >= meta.leased_until(renewed_at, self.max_lifetime_s):
            raise TensorRefError(f"tensor {ref.id}: expired (ttl {meta.ttl_s:g} s)")
        try:
            if reader.num_record_batches != 1:
                raise TensorRefError(f"tensor {ref.id}: expected one record batch")
            column = reader.get_batch(0).column(0)
            n = numel(ref.shape)
            if len(column) != n or column.null_count != 0 or column.offset != 0:
                raise TensorRefError(f"tensor {ref.id}: column length/nulls do not match")
            data = column.buffers()[1]
            offset = 0 if data is None else data.address - buf.address
            if ref.nbytes and (data is None or data.size < ref.nbytes or
                               not 0 <= offset <= size - ref.nbytes):  # fmt: skip
                # Compressed IPC bodies are decompressed into fresh memory: not zero-copy.
                raise TensorRefError(f"tensor {ref.id}: data is not inside the mapping")
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise TensorRefError(f"tensor {ref.id}: unreadable ({exc})") from None
        storage = np.dtype(np.uint8 if ref.dtype == "bool" else ref.dtype)
        # A view of the mapping itself (not of an Arrow buffer), so that its lifetime is
        # the pin's; the Arrow objects over the mapping go when this function returns.
        del reader, column, data, buf
        return np.frombuffer(mm, dtype=storage, count=n, offset=offset if n else 0), meta

    # -- delete, list, reclaim -------------------------------------------------------------
    @_os_errors_as_transport_errors
    def release(self, ref: TensorRef | Mapping[str, Any] | str) -> bool:
        """Delete a segment; idempotent. Readers that mapped it keep their views.

        A recycling store (``recycle_bytes > 0``) renames a file of at least 1 MiB into its
        pool instead, while the pool has room: the id is gone all the same, and the file is
        rewritten only once no reader maps it any more (see the module docstring).

        Args:
            ref: a :class:`TensorRef`, its wire dict, or a bare id.

        Returns:
            True if a segment was removed, False if it was already gone.

        Raises:
            TensorRefError: a malformed ref or id, or a name that is not a regular file.
        """
        seg_id = ref if isinstance(ref, str) else self._coerce(ref).id
        path = self._path(seg_id)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode):
            raise TensorRefError(f"tensor {seg_id}: not a regular file")
        if self.recycle_bytes and st.st_size >= _MIN_RECYCLE_BYTES and self._pool(path, st):
            return True
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        if self._kept:
            self._sweep_kept()
        return True

    # -- recycling (see the module docstring) ----------------------------------------------
    def _pool_entries(self) -> list[tuple[Path, os.stat_result]]:
        out = []
        with os.scandir(self.root) as it:
            for entry in it:
                if _POOL_RE.fullmatch(entry.name):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        out.append((self.root / entry.name, st))
        return out

    @_os_errors_as_transport_errors
    def pool_bytes(self) -> int:
        """Bytes held by released files kept for reuse (0 unless recycling)."""
        return sum(st.st_size for _, st in self._pool_entries())

    def _pool(self, path: Path, st: os.stat_result) -> bool:
        """Move a released segment into the pool if the budget allows; False: not pooled.
        Pool files idle past ``recycle_idle_s`` are unlinked first (so a producer that keeps
        releasing does not need :meth:`gc` to give idle pages back)."""
        with self._lock():
            now = time.time()
            pooled = 0
            present = set()
            for p, pst in self._pool_entries():
                if self._pool_idle(pst, now):
                    _unlink_quiet(p)
                else:
                    pooled += pst.st_size
                    present.add(p.name)
            self._own_pool &= present  # names claimed or reclaimed since are gone
            if pooled + st.st_size > self.recycle_bytes:
                return False
            try:
                # rename: the id's name is gone at once (no new reader can open it), and the
                # inode, with its allocated pages, stays for a later put.
                name = f".pool-{new_id()}{SEGMENT_SUFFIX}"
                os.rename(path, self.root / name)
            except FileNotFoundError:
                return False  # released concurrently; the caller's unlink says so
            self._own_pool.add(name)
        return True

    def _pool_idle(self, st: os.stat_result, now: float) -> bool:
        """Whether a pool file went unused past ``recycle_idle_s`` (its ctime is set by the
        rename into the pool and by a claim's utime)."""
        return now - st.st_ctime > self.recycle_idle_s

    def _claim_pooled(self, size: int, tmp: Path) -> tuple[int, int, _Kept | None] | None:
        """``(descriptor, its size, kept mapping or None)`` of a pool file renamed to ``tmp``,
        or None (caller holds the root lock). The closest fit at least ``size`` large (and at
        most twice as large) is preferred, then the closest one at most
        ``_RECYCLE_SLACK_BYTES`` smaller. Segments too small to be pooled claim nothing.

        Only a file whose exclusive ``flock`` is free is returned, and it is returned holding
        it (the caller drops it once the new segment is written): every reader holds a shared
        lock for as long as a view of the file lives, so no view ever sees another tensor's
        bytes. A file this process keeps mapped (:class:`_Kept`) is returned with its mapping
        when both the file and the mapping are exactly ``size`` bytes (checked under the
        lock: another process may have rewritten it at another size); otherwise the mapping
        is dropped. A file whose lock is taken is unlinked from the pool, never rewritten.
        """
        if size < _MIN_RECYCLE_BYTES - _RECYCLE_SLACK_BYTES:
            return None  # its file would never return to the pool: a larger put's loss
        candidates = sorted(
            (
                (p, st)
                for p, st in self._pool_entries()
                # From a little smaller to twice as large: a much larger file is kept for
                # the tensors of its own size.
                if size - _RECYCLE_SLACK_BYTES <= st.st_size <= 2 * size
            ),
            key=lambda e: (e[1].st_size != size, e[1].st_size < size, abs(e[1].st_size - size)),
        )
        for path, st in candidates:
            with self._kept_lock:
                kept = self._kept.pop((st.st_dev, st.st_ino), None)
            if kept is not None and kept.size != size:
                kept.close()
                kept = None
            if kept is not None:
                fd = kept.fd
            else:
                try:
                    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
                except OSError:
                    continue  # reclaimed meanwhile, or not a regular file
            locked = lock_exclusive(fd)
            fst = os.fstat(fd)
            if kept is not None and fst.st_size != kept.size:
                # Rewritten elsewhere at another size: writing through the mapping could
                # reach past the end of the file (SIGBUS). Use the descriptor alone.
                fd, kept = kept.detach(), None
            claimable = (
                locked
                and stat.S_ISREG(fst.st_mode)
                and fst.st_uid == self._uid
                and fst.st_nlink == 1
            )
            try:
                if claimable:
                    # Fresh times first: gc() must not take the claimed file for a stale one.
                    os.utime(fd)
                    os.rename(path, tmp)
                    return fd, fst.st_size, kept
            except OSError:
                claimable = True  # reclaimed meanwhile: nothing to unlink
            if kept is not None:
                kept.close()
            else:
                os.close(fd)
            if not claimable:
                # A reader has a live view of it (or it is not ours): never rewrite it.
                _unlink_quiet(path)
        return None

    # -- kept mappings (see _Kept) ---------------------------------------------------------
    def _keep(self, fd: int, size: int) -> None:
        """Map the file behind ``fd`` (which becomes the store's) and keep the mapping."""
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            os.close(fd)
            return
        self._remember(_Kept(fd, mm, size))

    def _remember(self, kept: _Kept) -> None:
        st = os.fstat(kept.fd)
        with self._kept_lock:
            self._kept[(st.st_dev, st.st_ino)] = kept
            # At most recycle_bytes mapped: the oldest mappings go first (their files stay).
            total = sum(k.size for k in self._kept.values())
            for key in list(self._kept):
                if total <= self.recycle_bytes:
                    break
                old = self._kept.pop(key)
                total -= old.size
                old.close()
            # A file unlinked elsewhere (the janitor, another store's trim) would keep its
            # pages while this producer idles: swept within a second.
            self._kept_sweeper.ensure()

    def _sweep_kept(self) -> None:
        """Drop mappings of files that are gone (their pages are not in any budget), and,
        in a forked child, the parent's mappings."""
        with self._kept_lock:
            if os.getpid() != self._kept_pid:
                for k in self._kept.values():
                    with suppress(OSError, ValueError):
                        k.close()  # the child's copies: unlocks nothing of the parent's
                self._kept.clear()
                self._kept_pid = os.getpid()
                return
            for key, k in list(self._kept.items()):
                if os.fstat(k.fd).st_nlink == 0:
                    del self._kept[key]
                    k.close()

    def _sweep_kept_tick(self) -> bool:
        self._sweep_kept()
        return bool(self._kept)

    def kept_bytes(self) -> int:
        """Bytes of segment files this process keeps mapped for rewriting (recycling only)."""
        with self._kept_lock:
            return sum(k.size for k in self._kept.values())

    def close(self) -> None:
        """Drop every mapping this store keeps for rewriting (recycling) and every unpinned
        one its reader cache keeps; the files stay."""
        with self._kept_lock:
            for k in self._kept.values():
                with suppress(OSError, ValueError):
                    k.close()
            self._kept.clear()
            self._kept_sweeper.stop()
        if self.reader_cache is not None:
            self.reader_cache.close()

    @_os_errors_as_transport_errors
    def trim_pool(self, only_own: bool = False) -> list[str]:
        """Unlink pool files; returns their names. Mapped pages go with the last mapping.

        Args:
            only_own: only the files this store put into the pool (and nobody has claimed
                since), not other producers' (``FleetClient.close`` uses it).
        """
        removed = []
        for path, _ in self._pool_entries():
            if only_own and path.name not in self._own_pool:
                continue
            _unlink_quiet(path)
            removed.append(path.name)
        self._own_pool.difference_update(removed)
        self._sweep_kept()
        return removed

    def _read_meta(self, seg_id: str) -> tuple[_Meta, int, float]:
        """Metadata, file size and mtime (last renewal) of a segment; touches only the IPC
        footer's pages."""
        fd = self._open_segment(seg_id)
        try:
            size = self._lock_for_reading(fd, seg_id)  # no claim truncates it meanwhile
            mtime = os.fstat(fd).st_mtime
            mm = pa.memory_map(f"/proc/self/fd/{fd}", "r")
            try:
                schema = pa.ipc.open_file(mm).schema
            except (pa.ArrowException, OSError, ValueError) as exc:
                raise TensorRefError(f"segment {seg_id}: not a valid IPC file ({exc})") from None
            finally:
                mm.close()
        finally:
            os.close(fd)
        return _Meta.from_schema(schema, seg_id), size, mtime

    def _owner_alive(self, meta: _Meta) -> bool:
        if meta.pid == 0 or owner_host(meta.owner) != hostname():
            return True  # detached, or another host's process: only the TTL applies
        return pid_alive(meta.pid, meta.pid_start)

    @_os_errors_as_transport_errors
    def info(self, seg_id: str) -> SegmentInfo:
        """One segment's metadata, from its file (not its data pages).

        Raises:
            TensorRefError: a malformed id, or a segment that is gone or unreadable.
        """
        meta, size, mtime = self._read_meta(seg_id)
        return SegmentInfo(
            id=meta.id,
            shape=meta.shape,
            dtype=meta.dtype,
            nbytes=meta.nbytes,
            file_bytes=size,
            owner=meta.owner,
            pid=meta.pid,
            created_at=meta.created_at,
            expires_at=meta.leased_until(mtime, self.max_lifetime_s),
            alive_owner=self._owner_alive(meta),
            ttl_s=meta.ttl_s,
            request=meta.request,
        )

    @_os_errors_as_transport_errors
    def ls(self) -> list[SegmentInfo]:
        """The readable segments, oldest first. Unreadable files are skipped (see :meth:`gc`)."""
        out = []
        with os.scandir(self.root) as it:
            names = [e.name for e in it]
        for name in names:
            m = _SEGMENT_RE.fullmatch(name)
            if not m:
                continue
            try:
                out.append(self.info(m[1]))
            except TensorRefError:
                continue  # vanished or corrupt
        out.sort(key=lambda s: s.created_at)
        return out

    @_os_errors_as_transport_errors
    def gc(self, now: float | None = None) -> list[str]:
        """Reclaim segments past their TTL (or their lease: see :mod:`shared.transport.lifetime`)
        or whose owner process died, and stale temp files.

        Args:
            now: the current time in epoch seconds (default: ``time.time()``); tests pass a
                future time to expire segments.

        Returns:
            What was removed: segment ids, the file names (starting with ``.tmp-``) of temp
            files left by writers that died or stalled longer than ``default_ttl_s``, and
            those (starting with ``.pool-``) of pool files idle longer than ``recycle_idle_s``.
            Unreadable segment files older than ``default_ttl_s`` (by mtime) are removed too.

        Safe to run concurrently with readers (their mappings stay valid) and with writers
        (a live writer's temp file is kept unless it stalled past ``default_ttl_s``).
        """
        now = time.time() if now is None else now
        removed: list[str] = []
        with os.scandir(self.root) as it:
            entries = list(it)
        for entry in entries:
            name = entry.name
            path = self.root / name
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue  # never follow or delete anything we did not create
            if m := _SEGMENT_RE.fullmatch(name):
                try:
                    meta, _, mtime = self._read_meta(m[1])
                    expires = meta.leased_until(mtime, self.max_lifetime_s)
                    stale = now >= expires or not self._owner_alive(meta)
                except TensorRefError:
                    stale = now - st.st_mtime > self.default_ttl_s  # corrupt: give it time
                if stale:
                    _unlink_quiet(path)
                    removed.append(m[1])
            elif _POOL_RE.fullmatch(name):
                if self._pool_idle(st, now):
                    _unlink_quiet(path)
                    removed.append(name)
            elif m := _TMP_RE.fullmatch(name):
                writer_pid, host = int(m[2]), m[3]
                dead = host == hostname() and not pid_alive(writer_pid)
                if dead or now - st.st_mtime > self.default_ttl_s:
                    _unlink_quiet(path)
                    removed.append(name)
        if removed:
            log.info("shm gc removed %d file(s) from %s", len(removed), self.root)
        self._sweep_kept()
        return removed


def _is_enospc(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # pyarrow may re-raise a Python write error as its own OSError subclass without errno.
    return isinstance(exc, OSError) and "No space left on device" in str(exc)
