"""The fleet directory in /dev/shm: its layout, its security checks, its lock and its budget.

Layout::

    /dev/shm/mmfleet-<uid>/                 mode 0700, owned by this uid, never a symlink
        t<32 hex>.arrow                     a segment, mode 0600, immutable once visible
        .tmp-t<32 hex>-<pid>-<host>.arrow   a segment being written (linked when complete)
        .pool-t<32 hex>.arrow               a released segment file kept for reuse (recycling
                                            stores only; its pages are already allocated)

File names are built from a validated id alone, so a message can never name a path; files
must be regular files owned by this uid.

Capacity: puts are serialised by an ``flock`` on the root (:class:`RootLock`) while the budget
is checked (:func:`ensure_room`) and the temp file is sized, so concurrent processes cannot
overshoot the budget; the data is written after the lock is released.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from shared.errors import ShmCapacityError, TransportError
from shared.transport.locks import ForkAware, watch_fork
from shared.transport.ref import hostname, new_id, validate_id

__all__ = [
    "MIN_SHM_WARN_BYTES",
    "POOL_RE",
    "SEGMENT_RE",
    "SEGMENT_SUFFIX",
    "TMP_RE",
    "RootLock",
    "capacity_warning",
    "default_root",
    "ensure_room",
    "fmt_bytes",
    "fs_free_bytes",
    "fs_total_bytes",
    "open_root",
    "pool_path",
    "segment_path",
    "tmp_path",
    "unlink_quiet",
    "used_bytes",
]

SEGMENT_SUFFIX = ".arrow"
SEGMENT_RE = re.compile(r"(t[0-9a-f]{32})\.arrow")
TMP_RE = re.compile(r"\.tmp-(t[0-9a-f]{32})-([0-9]{1,10})-([A-Za-z0-9._-]{1,64})\.arrow")
POOL_RE = re.compile(r"\.pool-(t[0-9a-f]{32})\.arrow")
MIN_SHM_WARN_BYTES = 256 * 1024 * 1024

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def default_root() -> Path:
    """The fleet directory of this uid: ``/dev/shm/mmfleet-<uid>``."""
    return Path(f"/dev/shm/mmfleet-{os.getuid()}")


def segment_path(root: Path, seg_id: str) -> Path:
    """The file of segment ``seg_id``.

    Raises:
        TensorRefError: a malformed id.
    """
    return root / f"{validate_id(seg_id)}{SEGMENT_SUFFIX}"


def tmp_path(root: Path, seg_id: str) -> Path:
    """Where this process writes segment ``seg_id`` before it is published."""
    return root / f".tmp-{seg_id}-{os.getpid()}-{hostname()}{SEGMENT_SUFFIX}"


def pool_path(root: Path) -> Path:
    """A fresh name for a released file kept for reuse."""
    return root / f".pool-{new_id()}{SEGMENT_SUFFIX}"


def unlink_quiet(path: Path) -> None:
    """Unlink ``path``; one that is gone already is no error."""
    with suppress(FileNotFoundError):
        os.unlink(path)


def open_root(root: Path, uid: int) -> None:
    """Create ``root`` with mode 0700 if missing, else check that it is safe to use.

    Raises:
        TransportError: the parent directory is missing (no /dev/shm: use the inline
            transport), or ``root`` is a symlink, not a directory, owned by another uid or
            not mode 0700.
        OSError: any other failure.
    """
    created = False
    try:
        os.mkdir(root, 0o700)
        created = True
    except FileExistsError:
        pass
    except FileNotFoundError:
        raise TransportError(
            f"cannot create {root}: {root.parent} does not exist "
            "(no shared /dev/shm on this host? use the inline transport)"
        ) from None
    if root.is_symlink():  # checked first for a clear message; O_NOFOLLOW below
        raise TransportError(f"refusing shm root {root}: it is a symlink")
    # O_NOFOLLOW + fstat/fchmod on the descriptor: no window in which a symlink swapped in
    # after the check could redirect the chmod.
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError as exc:
        what = "a symlink" if exc.errno == errno.ELOOP else "not a directory"
        raise TransportError(f"refusing shm root {root}: {what} ({exc})") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != uid:
            raise TransportError(f"refusing shm root {root}: owned by uid {st.st_uid}, not {uid}")
        mode = stat.S_IMODE(st.st_mode)
        if created and mode != 0o700:
            os.fchmod(fd, 0o700)  # the umask may have removed owner bits at mkdir
        elif mode != 0o700:
            raise TransportError(
                f"refusing shm root {root}: mode {mode:04o}, expected 0700 (fix: chmod 700 {root})"
            )
    finally:
        os.close(fd)


class RootLock(ForkAware):
    """The exclusive ``flock`` on the root that serialises capacity checks across processes.

    A fresh descriptor per :meth:`held`: flock locks belong to the open file description,
    which a forked child would otherwise share with its parent (and so not exclude it). A
    child forked while another thread holds the lock would keep it with its copy of the
    descriptor (and wait on itself at its first put): the fork hook closes the child's copies.
    The guard keeps a fork out of the windows where a descriptor is open but not (or no
    longer) registered.
    """

    fork_rank = 0  # before the reader caches: a view collected under the guard takes theirs

    def __init__(self, root: Path) -> None:
        self.root = root
        self._guard = threading.Lock()
        self._fds: set[int] = set()  # descriptors holding (or about to hold) the lock
        watch_fork(self)

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock for the ``with`` block (waits for other holders)."""
        with self._guard:
            fd = os.open(self.root, _DIR_FLAGS)
            self._fds.add(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            with self._guard:
                self._fds.discard(fd)
                os.close(fd)  # closing releases the lock

    def before_fork(self) -> None:
        self._guard.acquire()

    def after_fork_in_parent(self) -> None:
        self._guard.release()

    def after_fork_in_child(self) -> None:
        self._guard.release()  # taken by the forking thread, which goes on in the child
        for fd in list(self._fds):
            # Another thread of the parent held the lock: closing the child's copy leaves the
            # lock to the parent (which drops it when its own copy closes).
            with suppress(OSError):
                os.close(fd)
        self._fds = set()


# -- capacity --------------------------------------------------------------------------------
def fs_total_bytes(root: Path) -> int:
    """Size of the filesystem holding ``root`` (``/dev/shm``), in bytes."""
    st = os.statvfs(root)
    return st.f_blocks * st.f_frsize


def fs_free_bytes(root: Path) -> int:
    """Bytes still available on the filesystem holding ``root``."""
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


def used_bytes(root: Path) -> int:
    """Bytes held by the root's files: segments, in-progress temp files and pool files.

    File sizes, each inode once (a segment is briefly linked under two names while it is
    published). Released segments still mapped by a reader are not counted, although tmpfs
    keeps their pages until the last mapping goes.
    """
    total = 0
    seen: set[int] = set()
    with os.scandir(root) as it:
        for entry in it:
            if not _ours(entry.name):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
    return total


def _ours(name: str) -> bool:
    """Whether ``name`` is a segment, temp or pool file name."""
    return any(p.fullmatch(name) for p in (SEGMENT_RE, TMP_RE, POOL_RE))


def ensure_room(
    root: Path, size: int, capacity_bytes: int, reclaimers: Iterable[Callable[[], object]]
) -> None:
    """Return if ``size`` more bytes fit in the budget and the filesystem (the caller holds
    the root lock); before refusing, run each of ``reclaimers`` in turn (a truthy result: it
    freed something) while the budget is short.

    Raises:
        ShmCapacityError: the budget or the filesystem lacks room.
    """
    used = used_bytes(root)
    for reclaim in reclaimers:
        if used + size > capacity_bytes and reclaim():
            used = used_bytes(root)
    if used + size > capacity_bytes:
        raise ShmCapacityError(
            f"shared-memory budget exceeded: {fmt_bytes(size)} requested, "
            f"{fmt_bytes(used)} of {fmt_bytes(capacity_bytes)} in use"
        )
    free = fs_free_bytes(root)
    if size > free:
        raise ShmCapacityError(
            f"{root.parent} has {fmt_bytes(free)} free, {fmt_bytes(size)} requested"
        )


def capacity_warning(
    root: Path, capacity_bytes: int, min_bytes: int = MIN_SHM_WARN_BYTES
) -> str | None:
    """A warning for the startup log when /dev/shm cannot hold what the budget promises, or
    the budget is under ``min_bytes`` (a container left at Docker's 64 MB ``shm_size`` is
    caught here); None when all is well. The message names the sizes and the fix."""
    total, free, used = fs_total_bytes(root), fs_free_bytes(root), used_bytes(root)
    short_fs = total < capacity_bytes
    short_free = not short_fs and free + used < capacity_bytes
    problems = []
    if short_fs:
        problems.append(
            f"{root.parent} holds {fmt_bytes(total)}, less than the transport "
            f"budget of {fmt_bytes(capacity_bytes)}"
        )
    elif short_free:
        problems.append(
            f"only {fmt_bytes(free)} free in {root.parent} (other users hold the "
            f"rest), less than the unused budget of {fmt_bytes(capacity_bytes - used)}"
        )
    if capacity_bytes < min_bytes:
        problems.append(
            f"the transport budget is only {fmt_bytes(capacity_bytes)} (< {fmt_bytes(min_bytes)})"
        )
    if not problems:
        return None
    enlarge = f"enlarge {root.parent} (docker run --shm-size, compose shm_size, a larger tmpfs)"
    fixes = []
    if short_fs or short_free:
        fixes.append(f"{enlarge} or lower the budget to what it holds")
    if capacity_bytes < min_bytes:
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


def fmt_bytes(n: float) -> str:
    """``n`` bytes for a message: ``"512 B"``, ``"1.5 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - loop always returns
