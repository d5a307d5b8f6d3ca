"""The read path: open a segment by id, lock it, map it (or find it in the reader cache), and
return the checked zero-copy view (:func:`.segment.view`).

A reader takes a shared ``flock`` on the file, maps it, parses the IPC file over the mapping
and returns a numpy array over the data bytes of the mapping itself. A mapping stays valid
after the segment is released or reclaimed (tmpfs frees the pages when the last mapping goes),
and it holds the shared lock for as long as it lives (the lock belongs to the open file
description, which the mapping keeps), so a recycling producer never rewrites a file under a
live view (:mod:`.pool`). Views of files a recycling store wrote come from the reader cache
when there is one (:mod:`.mapcache`).
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import TypeVar

import numpy as np

from shared.errors import TensorRefError, TransportError
from shared.transport import segment
from shared.transport.locks import lock_shared
from shared.transport.mapcache import Mapping, MappingCache
from shared.transport.ref import TensorRef
from shared.transport.root import segment_path

__all__ = ["Reader", "reclaimed"]

_T = TypeVar("_T")
# Out of descriptors or memory: the process's trouble, not the ref's.
_RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


def reclaimed(seg_id: str) -> TensorRefError:
    """The error of a read that found the segment's file being rewritten as another one."""
    return TensorRefError(f"unknown tensor {seg_id}: released and reclaimed")


class Reader:
    """Reads the segments of ``root`` (files owned by ``uid``), through ``cache`` if given;
    renewals never keep a segment past its write time plus ``max_lifetime_s`` seconds."""

    def __init__(
        self, root: Path, uid: int, cache: MappingCache | None, max_lifetime_s: float
    ) -> None:
        self.root, self.uid, self.cache = root, uid, cache
        self.max_lifetime_s = max_lifetime_s

    def open(self, seg_id: str) -> int:
        """An O_RDONLY descriptor of a segment that is a non-empty regular file of ``uid``.

        Raises:
            TensorRefError: a malformed id, no such segment, or not such a file.
            TransportError: out of descriptors or memory.
        """
        path = segment_path(self.root, seg_id)
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
        if not stat.S_ISREG(st.st_mode) or st.st_uid != self.uid or st.st_size == 0:
            os.close(fd)
            raise TensorRefError(f"tensor {seg_id}: not a non-empty regular file of this user")
        return fd

    def lock(self, fd: int, seg_id: str) -> int:
        """Take the shared lock every reader holds while it maps a segment; returns the file's
        size in bytes, read under the lock (no claim truncates it meanwhile).

        Raises:
            TensorRefError: a producer holds the exclusive lock: the file is being rewritten
                as another segment, so this one was released.
        """
        if not lock_shared(fd):
            raise reclaimed(seg_id)
        size = os.fstat(fd).st_size
        if size == 0:
            raise TensorRefError(f"tensor {seg_id}: not a non-empty regular file of this user")
        return size

    def load(self, ref: TensorRef, *, private: bool) -> np.ndarray:
        """Map ``ref``'s segment (or find it in the cache), check it, and return the view of
        ``ref.shape`` and ``ref.dtype``: read-only, or copy-on-write (``MAP_PRIVATE``) when
        ``private``. The view holds the segment's shared lock until it is collected: a plain
        mapping through its own open file description (the lock goes with the mapping), a
        cached one through a pin. Private views never use the cache.

        Raises:
            TensorRefError: see :meth:`open`, :meth:`lock` and :func:`.segment.view`.
            TransportError: the mapping failed (out of descriptors or memory).
        """
        fd = self.open(ref.id)
        cache = None if private else self.cache
        entry = None
        try:
            entry = self._pin(cache, fd, ref.id)
            if entry is not None:
                mm, size = entry.mm, entry.size
            else:
                size = self.lock(fd, ref.id)
                mm = self._map(fd, size, ref.id, private)
            arr, meta = self._checked_view(ref, mm, size, fd, unmap=entry is None)
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

    def _pin(self, cache: MappingCache | None, fd: int, seg_id: str) -> Mapping | None:
        if cache is None:
            return None
        try:
            return cache.pin(fd)
        except BlockingIOError:
            raise reclaimed(seg_id) from None

    def _map(self, fd: int, size: int, seg_id: str, private: bool) -> mmap.mmap:
        # Copy-on-write when private: writes stay in this process (see ShmStore.get_torch).
        flags, prot = (
            (mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
            if private
            else (mmap.MAP_SHARED, mmap.PROT_READ)
        )
        try:
            return self._with_descriptors(lambda: mmap.mmap(fd, size, flags=flags, prot=prot))
        except OSError as exc:  # EMFILE (Python's mmap dups fd), ENOMEM
            raise TransportError(f"cannot map tensor {seg_id}: {exc}") from None

    def _checked_view(
        self, ref: TensorRef, mm: mmap.mmap, size: int, fd: int, *, unmap: bool
    ) -> tuple[np.ndarray, segment.SegmentMeta]:
        """:func:`.segment.view`; on failure the mapping is unmapped first when ``unmap``."""
        failure: str | None = None
        try:
            return segment.view(
                ref,
                mm,
                size,
                renewed_at=os.fstat(fd).st_mtime,
                max_lifetime_s=self.max_lifetime_s,
                now=time.time(),
            )
        except TensorRefError as exc:
            failure = exc.message
        # Raised afresh, outside the except block: the caught exception's traceback holds
        # frames that hold Arrow buffers over the mapping, and a caller that keeps the
        # exception (Celery does, in a reference cycle) would keep the mapping, its tmpfs pages
        # and its shared lock alive until a GC pass. Here nothing exports the mapping any more.
        if unmap:
            with suppress(BufferError):
                mm.close()
        raise TensorRefError(failure)

    def _with_descriptors(self, call: Callable[[], _T]) -> _T:
        """``call()``; when the process is out of descriptors, once more after the reader
        cache gave back those of the mappings no view uses."""
        try:
            return call()
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            if self.cache is None or not self.cache.drop_unpinned():
                raise
        return call()
