"""Recycling: released segment files kept for reuse, and the writer's mappings of them.

With 4 KiB tmpfs pages, allocating a segment's pages costs more than copying into them
(figures: ``docs/transport.md``). A recycling store (``recycle_bytes > 0``) therefore
gives a released file of at least 1 MiB back to the :class:`Pool` (a rename to
``.pool-<random>``) instead of unlinking it, up to ``recycle_bytes`` in all; a later put
claims the pool file closest in size (at least as large and at most twice as large, else at
most 64 KiB smaller; a segment under about 1 MiB claims none), truncates it to the exact size
and writes the new segment into its allocated pages, under a new random id.

A pool file is reused only when no reader has a live view of it: after the rename no process
can open it by id any more, and the claim takes an exclusive ``flock`` without waiting, which
every reader's shared lock denies (a reader locks before it maps, and keeps the lock as long as
any view of the file lives). The claim holds the lock until the new segment is written; a file
it cannot lock is unlinked instead (its pages go when the last mapping does). So a view never
sees another tensor's data. (A write lease, ``F_SETLEASE``, proved the same until a reader
could keep a mapping without a view: see :mod:`.mapcache`. Locks are advisory: a process that
maps segment files without this package is not protected.) Pool files count in the capacity
budget, are dropped first when a put needs room, and are collected once idle for
``recycle_idle_s``.

The writer also keeps a writable mapping of each file it writes (:class:`KeptMappings`, at
most ``recycle_bytes`` of them); when it claims such a file again for a segment of exactly its
size (one shape from one process: the metadata is fixed-width), it writes through that
mapping, whose pages are faulted in already: one memcpy instead of a ``write()``. The claim's
lock is then taken on the mapping's own file description, and the file's size is checked under
it (another process may have claimed and resized the file meanwhile). Mappings of files that
are gone (unlinked by a gc in any process) are dropped at the next put, release or gc and by a
sweeper thread; a forked child drops its copies at the fork.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from shared.transport.locks import (
    ForkAware,
    Sweeper,
    lock_exclusive,
    unmap_and_close,
    watch_fork,
)
from shared.transport.root import POOL_RE, RootLock, pool_path, unlink_quiet

__all__ = ["MIN_RECYCLE_BYTES", "Claim", "Kept", "KeptMappings", "Pool"]

MIN_RECYCLE_BYTES = 1 << 20  # smaller files are cheap to allocate: unlinked, never pooled
# A pool file this much smaller than a new segment still serves it (the rest is allocated by
# the write): two tensors of one shape differ by a few bytes of metadata (times, ids, pids).
_RECYCLE_SLACK_BYTES = 64 << 10


@dataclass
class Kept:
    """A writable shared mapping of a segment file this process wrote, kept after the write,
    with the open file description it came from (``fd``) and its size in bytes."""

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


class KeptMappings(ForkAware):
    """The writer's kept mappings, by file (``(st_dev, st_ino)``), at most ``budget_bytes``
    of them (the oldest go first; their files stay).

    Thread-safe: a worker's janitor thread runs gc on the store its inference threads put to.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = int(budget_bytes)
        self._kept: dict[tuple[int, int], Kept] = {}
        self._lock = threading.RLock()
        self._sweeper = Sweeper(self._sweep_tick, 1.0, self._lock, "shm-kept-sweeper")
        watch_fork(self)

    def take(self, st: os.stat_result) -> Kept | None:
        """Remove and return the mapping of the file ``st`` describes, if one is kept."""
        with self._lock:
            return self._kept.pop((st.st_dev, st.st_ino), None)

    def keep(self, fd: int, size: int) -> None:
        """Map the file behind ``fd`` (which becomes this object's) and keep the mapping."""
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            os.close(fd)
            return
        self.remember(Kept(fd, mm, size))

    def remember(self, kept: Kept) -> None:
        """Keep ``kept`` (which becomes this object's)."""
        st = os.fstat(kept.fd)
        with self._lock:
            self._kept[(st.st_dev, st.st_ino)] = kept
            total = sum(k.size for k in self._kept.values())
            for key in list(self._kept):
                if total <= self.budget_bytes:
                    break
                old = self._kept.pop(key)
                total -= old.size
                old.close()
            # A file unlinked elsewhere (the janitor, another store's trim) would keep its
            # pages while this producer idles: swept within a second.
            self._sweeper.ensure()

    def sweep(self) -> None:
        """Drop mappings of files that are gone (their pages are not in any budget)."""
        with self._lock:
            for key, k in list(self._kept.items()):
                if os.fstat(k.fd).st_nlink == 0:
                    del self._kept[key]
                    k.close()

    def _sweep_tick(self) -> bool:
        self.sweep()
        return bool(self._kept)

    def __bool__(self) -> bool:
        return bool(self._kept)

    def bytes(self) -> int:
        """Bytes of the files kept mapped."""
        with self._lock:
            return sum(k.size for k in self._kept.values())

    def close(self) -> None:
        """Drop every mapping (the files stay) and stop the sweeper."""
        with self._lock:
            self._close_all()
            self._sweeper.stop()

    def _close_all(self) -> None:
        for k in self._kept.values():
            with suppress(OSError, ValueError):
                k.close()
        self._kept.clear()

    def after_fork_in_child(self) -> None:
        # A lock held by a parent's thread at the fork would never be released in the child.
        self._lock = threading.RLock()
        self._sweeper.reset_after_fork(self._lock)
        self._close_all()  # the child's copies: unlocks nothing of the parent's


@dataclass
class Claim:
    """A pool file renamed to a temp name for a new segment: its descriptor (holding the
    exclusive lock), its size in bytes, and the writer's kept mapping of it when that fits."""

    fd: int
    size: int
    kept: Kept | None


class Pool(ForkAware):
    """The root's pool files (see the module docstring).

    Args:
        root: the fleet directory; ``lock``: its :class:`~.root.RootLock`.
        uid: only files owned by this uid are claimed.
        budget_bytes: the most bytes of pool files in all (``recycle_bytes``).
        idle_s: a pool file unused this long is collected, in seconds.
        kept: the writer's kept mappings, used and updated by claims.
    """

    def __init__(
        self,
        root: Path,
        lock: RootLock,
        uid: int,
        budget_bytes: int,
        idle_s: float,
        kept: KeptMappings,
    ) -> None:
        self.root, self.lock, self.uid = root, lock, uid
        self.budget_bytes, self.idle_s = int(budget_bytes), float(idle_s)
        self.kept = kept
        self._own: set[str] = set()  # names this process put into the pool (see trim)
        watch_fork(self)

    def entries(self) -> list[tuple[Path, os.stat_result]]:
        """The pool's regular files and their stat."""
        out = []
        with os.scandir(self.root) as it:
            for entry in it:
                if POOL_RE.fullmatch(entry.name):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        out.append((self.root / entry.name, st))
        return out

    def bytes(self) -> int:
        """Bytes held by pool files."""
        return sum(st.st_size for _, st in self.entries())

    def idle(self, st: os.stat_result, now: float) -> bool:
        """Whether a pool file went unused past ``idle_s`` (its ctime is set by the rename
        into the pool and by a claim's utime)."""
        return now - st.st_ctime > self.idle_s

    def give_back(self, path: Path, st: os.stat_result) -> bool:
        """Move a released segment file into the pool if the budget allows; False: not pooled.

        Pool files idle past ``idle_s`` are unlinked first (so a producer that keeps releasing
        does not need gc to give idle pages back).
        """
        with self.lock.held():
            now = time.time()
            pooled = 0
            present = set()
            for p, pst in self.entries():
                if self.idle(pst, now):
                    unlink_quiet(p)
                else:
                    pooled += pst.st_size
                    present.add(p.name)
            self._own &= present  # names claimed or reclaimed since are gone
            if pooled + st.st_size > self.budget_bytes:
                return False
            target = pool_path(self.root)
            try:
                # rename: the id's name is gone at once (no new reader can open it), and the
                # inode, with its allocated pages, stays for a later put.
                os.rename(path, target)
            except FileNotFoundError:
                return False  # released concurrently; the caller's unlink says so
            self._own.add(target.name)
        return True

    def claim(self, size: int, tmp: Path) -> Claim | None:
        """A pool file of about ``size`` bytes renamed to ``tmp``, or None (the caller holds
        the root lock). The closest fit at least ``size`` large (and at most twice as large)
        is preferred, then the closest one at most 64 KiB smaller. Segments too small to be
        pooled claim nothing.

        Only a file whose exclusive ``flock`` is free is returned, and it is returned holding
        it (the caller drops it once the new segment is written). The writer's kept mapping of
        the file comes with it when both are exactly ``size`` bytes (checked under the lock);
        otherwise the mapping is dropped. A file whose lock is taken is unlinked, never
        rewritten.
        """
        if size < MIN_RECYCLE_BYTES - _RECYCLE_SLACK_BYTES:
            return None  # its file would never return to the pool: a larger put's loss
        candidates = sorted(
            (
                (p, st)
                for p, st in self.entries()
                # From a little smaller to twice as large: a much larger file is kept for
                # the tensors of its own size.
                if size - _RECYCLE_SLACK_BYTES <= st.st_size <= 2 * size
            ),
            key=lambda e: (e[1].st_size != size, e[1].st_size < size, abs(e[1].st_size - size)),
        )
        for path, st in candidates:
            claim = self._try_claim(path, st, size, tmp)
            if claim is not None:
                return claim
        return None

    def _try_claim(self, path: Path, st: os.stat_result, size: int, tmp: Path) -> Claim | None:
        kept = self.kept.take(st)
        if kept is not None and kept.size != size:
            kept.close()
            kept = None
        if kept is not None:
            fd = kept.fd
        else:
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                return None  # reclaimed meanwhile, or not a regular file
        locked = lock_exclusive(fd)
        fst = os.fstat(fd)
        if kept is not None and fst.st_size != kept.size:
            # Rewritten elsewhere at another size: writing through the mapping could reach
            # past the end of the file (SIGBUS). Use the descriptor alone.
            fd, kept = kept.detach(), None
        claimable = (
            locked and stat.S_ISREG(fst.st_mode) and fst.st_uid == self.uid and fst.st_nlink == 1
        )
        try:
            if claimable:
                # Fresh times first: gc must not take the claimed file for a stale one.
                os.utime(fd)
                os.rename(path, tmp)
                return Claim(fd, fst.st_size, kept)
        except OSError:
            claimable = True  # reclaimed meanwhile: nothing to unlink
        if kept is not None:
            kept.close()
        else:
            os.close(fd)
        if not claimable:
            # A reader has a live view of it (or it is not ours): never rewrite it.
            unlink_quiet(path)
        return None

    def trim(self, only_own: bool = False) -> list[str]:
        """Unlink pool files (only those this process put there and nobody claimed since,
        with ``only_own``); returns their names. Mapped pages go with the last mapping."""
        removed = []
        for path, _ in self.entries():
            if only_own and path.name not in self._own:
                continue
            unlink_quiet(path)
            removed.append(path.name)
        self._own.difference_update(removed)
        self.kept.sweep()
        return removed

    def after_fork_in_child(self) -> None:
        self._own = set()  # the parent's pool files are not the child's to trim
