"""A reader's cache of segment mappings whose page tables outlive the views over them.

Mapping a file costs more than the mapping call: the first touch of each 4 KiB page faults it
into the process's page tables, which for a large segment costs about as much as reading it
(figures: ``docs/transport.md``). A recycling producer (:mod:`.pool`) rewrites the same
files, so a reader that keeps its mapping of such a file finds the next segment written into
it with the page tables ready: the same idea as Triton's registered shared-memory regions and
Plasma's client-side mapping of the store, without changing what a
:class:`~shared.transport.TensorRef` is.

Safety rests on the store's lock protocol (``flock`` on the segment's inode, :mod:`.locks`): a
reader holds a shared lock for as long as any view of the file is alive, a producer rewrites a
pool file only under an exclusive lock that it takes without waiting (so never while a view
exists). A cached mapping with no live view holds no lock: its pages may then change under it,
which is harmless because nothing reads them. Each :class:`Mapping` is *pinned* by its live
views (a ``weakref.finalize`` on the base array every view derives from); the first pin takes
the shared lock on the entry's own open file description, the last unpin drops it.

Bounded by ``capacity_bytes`` and ``max_entries`` (each entry holds two descriptors; least
recently used unpinned entries go first; all unpinned ones when the process runs out of
descriptors). A mapping of a file that was unlinked (by the
producer's trim, the janitor, a dead owner's gc) would keep its tmpfs pages allocated, so
unpinned ones are dropped when their last view goes and by a :class:`~.locks.Sweeper` thread
(every ``sweep_interval_s``, alive only while the cache holds something).

Fork: a child shares its parent's open file descriptions, and a ``flock`` belongs to the
description, so a ``LOCK_UN`` on either side (a view collected there, or at exit) would drop
the lock the other side's live view relies on. The cache's fork hooks (:mod:`.locks`)
therefore make sure neither side ever unlocks a description both hold: the child disowns every
entry (it closes its copies of the descriptors, which unlocks nothing; its views keep their
mappings), and the parent marks the entries pinned at the fork as shared: when their last view
goes it closes its references instead of unlocking. The lock then goes with the description's
last reference, in whichever process that is. (No descriptor is needed at fork time, so a
process out of descriptors forks safely too.) The child gets a fresh cache lock.

Re-entrancy: a view may be collected by the cyclic GC at any allocation, also inside a cache
method on the same thread; its finalizer then re-enters the (reentrant) lock and may remove
entries. So the cache never iterates its dict directly, only snapshots of it.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import weakref
from collections import OrderedDict
from contextlib import suppress
from dataclasses import dataclass, field

import numpy as np

from shared.transport.locks import (
    ForkAware,
    Sweeper,
    lock_shared,
    unlock,
    unmap_and_close,
    watch_fork,
)

__all__ = ["Mapping", "MappingCache"]


@dataclass(eq=False)
class Mapping:
    """One cached read-only shared mapping of a whole segment file.

    ``fd`` is the entry's own open file description (the lock is taken on it); ``size`` the
    file's size in bytes when it was mapped, which no writer can change while the entry is
    pinned (a writer needs the exclusive lock).
    """

    key: tuple[int, int]  # (st_dev, st_ino)
    fd: int
    mm: mmap.mmap
    size: int
    pins: int = 0
    closed: bool = field(default=False, repr=False)
    # Pinned when this process forked: the child shares the description, and so the lock.
    shared: bool = field(default=False, repr=False)

    def close(self) -> None:
        """Unmap and close the descriptor, once."""
        if not self.closed:
            self.closed = True
            unmap_and_close(self.mm, self.fd)


class MappingCache(ForkAware):
    """Mappings of recycled segment files, kept between views (see the module docstring).

    Args:
        capacity_bytes: the most bytes of files kept mapped together (> 0).
        sweep_interval_s: how often the sweeper drops mappings of unlinked files, in seconds.
        max_entries: the most files kept mapped (each holds two descriptors: the entry's and
            the one Python's ``mmap`` keeps).

    Thread-safe: views are collected on whatever thread drops them.
    """

    def __init__(
        self, capacity_bytes: int, sweep_interval_s: float = 1.0, max_entries: int = 64
    ) -> None:
        if capacity_bytes <= 0 or sweep_interval_s <= 0 or max_entries <= 0:
            raise ValueError("capacity_bytes, sweep_interval_s and max_entries must be > 0")
        self.capacity_bytes = int(capacity_bytes)
        self.sweep_interval_s = float(sweep_interval_s)
        self.max_entries = int(max_entries)
        self._entries: OrderedDict[tuple[int, int], Mapping] = OrderedDict()
        self._lock = threading.RLock()  # a view may be collected inside a cache call
        self._sweeper = Sweeper(self._sweep_tick, sweep_interval_s, self._lock, "shm-map-sweeper")
        self._closed = False
        self.hits = 0  # views served from a mapping already in the cache
        self.adopted = 0  # mappings taken into the cache
        watch_fork(self)

    # -- lookup ----------------------------------------------------------------------------
    def pin(self, fd: int) -> Mapping | None:
        """The cached mapping of ``fd``'s file, pinned (shared lock held), or None.

        ``fd`` is the caller's freshly opened descriptor of the segment; it is only fstat'ed.
        None: not cached, or cached at another size (that entry is dropped when unpinned).

        Raises:
            BlockingIOError: the file is being rewritten by a producer (so the segment the
                caller opened was released meanwhile).
        """
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry.pins == 0 and not lock_shared(entry.fd):
                raise BlockingIOError(errno.EWOULDBLOCK, "segment file is being rewritten")
            entry.pins += 1
            # Under the lock the size cannot change; it may have before (a claim elsewhere
            # truncated the file to another segment's size): then this mapping is unusable.
            if os.fstat(entry.fd).st_size != entry.size:
                self._unpin_locked(entry)
                self._drop_locked(entry)
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def adopt(self, fd: int, mm: mmap.mmap, size: int) -> Mapping | None:
        """Take a mapping the caller made (``fd`` locked shared) into the cache, pinned.

        Returns the entry, which now owns ``fd`` and ``mm``; None when it does not fit (every
        other entry pinned, or larger than the capacity): the caller keeps both.
        """
        if size > self.capacity_bytes:
            return None
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            entries = list(self._entries.values())
            total, count = sum(e.size for e in entries), len(entries)
            unpinned = [e for e in entries if e.pins == 0]  # least recently used first
            if (
                key in self._entries
                or total - sum(e.size for e in unpinned) + size > self.capacity_bytes
                or count - len(unpinned) + 1 > self.max_entries
            ):
                return None  # would not fit even with every unpinned entry gone: keep them
            for old in unpinned:
                if total + size <= self.capacity_bytes and count + 1 <= self.max_entries:
                    break
                total, count = total - old.size, count - 1
                self._drop_locked(old)
            entry = Mapping(key, fd, mm, size, pins=1)
            self._entries[key] = entry
            self._closed = False
            self.adopted += 1
            self._sweeper.ensure()
            return entry

    def attach(self, entry: Mapping, view: np.ndarray) -> None:
        """Unpin ``entry`` once ``view`` (and every view derived from it) is collected."""
        weakref.finalize(view, self.unpin, entry)

    def unpin(self, entry: Mapping) -> None:
        """Drop one pin; the last one releases the shared lock."""
        with self._lock:
            self._unpin_locked(entry)
            if entry.pins == 0 and not entry.closed and (self._closed or _unlinked(entry)):
                self._drop_locked(entry)

    # -- housekeeping ------------------------------------------------------------------------
    def drop_unpinned(self) -> int:
        """Drop every mapping no view uses (e.g. to give descriptors back); returns how many."""
        with self._lock:
            idle = [e for e in list(self._entries.values()) if e.pins == 0]
            for entry in idle:
                self._drop_locked(entry)
            return len(idle)

    def sweep(self) -> int:
        """Drop unpinned mappings of files that were unlinked; returns how many."""
        with self._lock:
            return self._sweep_locked()

    def mapped_bytes(self) -> int:
        """Bytes of files this cache keeps mapped."""
        with self._lock:
            return sum(e.size for e in list(self._entries.values()))

    def close(self) -> None:
        """Drop every unpinned mapping and stop the sweeper; a pinned one goes with its last
        view. A later :meth:`adopt` opens the cache again."""
        with self._lock:
            self._closed = True
            for entry in list(self._entries.values()):
                if entry.pins == 0:
                    self._drop_locked(entry)
            self._sweeper.stop()

    def __len__(self) -> int:
        return len(self._entries)

    # -- internals (caller holds self._lock) --------------------------------------------------
    def _unpin_locked(self, entry: Mapping) -> None:
        if entry.pins <= 0:
            return
        entry.pins -= 1
        if entry.pins == 0 and not entry.closed:
            if entry.shared:
                # A LOCK_UN would unlock the child's views too: close our references
                # instead; the lock goes with the description's last one, in either process.
                self._drop_locked(entry)
            else:
                unlock(entry.fd)

    def _drop_locked(self, entry: Mapping) -> None:
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        if entry.pins == 0:
            entry.close()
        # A pinned entry leaves the cache but stays mapped: its views close it via unpin.

    def _sweep_locked(self) -> int:
        gone = [e for e in list(self._entries.values()) if e.pins == 0 and _unlinked(e)]
        for entry in gone:
            if entry.pins == 0:  # a finalizer cannot pin, but stay exact
                self._drop_locked(entry)
        return len(gone)

    def _sweep_tick(self) -> bool:
        self._sweep_locked()
        return bool(self._entries)

    # -- fork (see the module docstring) -------------------------------------------------------
    def before_fork(self) -> None:
        self._lock.acquire()  # held across the fork: no entry changes meanwhile

    def after_fork_in_parent(self) -> None:
        for entry in list(self._entries.values()):
            if entry.pins > 0:
                entry.shared = True  # the child may hold views on it: never unlock it
        self._lock.release()

    def after_fork_in_child(self) -> None:
        self._lock = threading.RLock()
        self._sweeper.reset_after_fork(self._lock)
        for entry in list(self._entries.values()):
            # Disowned: closing the child's copies never unlocks anything (a flock goes with
            # the description's last reference); a view here keeps the mapping, and with it
            # a reference to the locked description, until it is collected.
            entry.closed = True
            with suppress(OSError):
                os.close(entry.fd)
            if entry.pins == 0:
                with suppress(BufferError):
                    entry.mm.close()
            entry.pins = 0
        self._entries.clear()


def _unlinked(entry: Mapping) -> bool:
    try:
        return os.fstat(entry.fd).st_nlink == 0
    except OSError:
        return True
