"""What is in the root: one segment's metadata, the list of segments, and the collection of
what is stale (expired or orphaned segments, dead writers' temp files, idle pool files).

Reading a segment's metadata maps the file and parses the IPC footer: it touches only the
footer's pages, never the tensor data. A segment's owner is alive while its process is (the
pid and its start time, on this host: :mod:`shared.procs`); a detached segment, or one written
on another host, lives by its TTL alone.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Collection
from dataclasses import dataclass

import pyarrow as pa

from shared.errors import TensorRefError
from shared.procs import pid_alive
from shared.transport.pool import Pool
from shared.transport.reader import Reader
from shared.transport.ref import hostname, owner_host
from shared.transport.root import POOL_RE, SEGMENT_RE, TMP_RE, unlink_quiet
from shared.transport.segment import SegmentMeta, read_schema

__all__ = ["Inventory", "SegmentInfo"]

log = logging.getLogger(__name__)


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


def owner_alive(meta: SegmentMeta) -> bool:
    """Whether the process a segment is tied to may still use it."""
    if meta.pid == 0 or owner_host(meta.owner) != hostname():
        return True  # detached, or another host's process: only the TTL applies
    return pid_alive(meta.pid, meta.pid_start)


class Inventory:
    """Lists and collects the segments of ``reader.root`` (see the module docstring).

    Args:
        reader: opens and locks segment files.
        pool: the root's pool (its idle files are collected).
        default_ttl_s: a temp file whose writer stalled this long, or an unreadable segment
            file this old (by mtime), is collected, in seconds.
    """

    def __init__(self, reader: Reader, pool: Pool, default_ttl_s: float) -> None:
        self.reader, self.pool = reader, pool
        self.root = reader.root
        self.default_ttl_s = default_ttl_s

    def read_meta(self, seg_id: str) -> tuple[SegmentMeta, int, float]:
        """Metadata, file size and mtime (last renewal) of a segment.

        Raises:
            TensorRefError: a malformed id, or a segment that is gone or unreadable.
        """
        fd = self.reader.open(seg_id)
        try:
            size = self.reader.lock(fd, seg_id)  # no claim truncates it meanwhile
            mtime = os.fstat(fd).st_mtime
            mm = pa.memory_map(f"/proc/self/fd/{fd}", "r")
            try:
                schema = read_schema(mm, seg_id)
            finally:
                mm.close()
        finally:
            os.close(fd)
        return SegmentMeta.from_schema(schema, seg_id), size, mtime

    def info(self, seg_id: str) -> SegmentInfo:
        """One segment's metadata, from its file (not its data pages).

        Raises:
            TensorRefError: a malformed id, or a segment that is gone or unreadable.
        """
        meta, size, mtime = self.read_meta(seg_id)
        return SegmentInfo(
            id=meta.id,
            shape=meta.shape,
            dtype=meta.dtype,
            nbytes=meta.nbytes,
            file_bytes=size,
            owner=meta.owner,
            pid=meta.pid,
            created_at=meta.created_at,
            expires_at=meta.leased_until(mtime, self.reader.max_lifetime_s),
            alive_owner=owner_alive(meta),
            ttl_s=meta.ttl_s,
            request=meta.request,
        )

    def ls(self) -> list[SegmentInfo]:
        """The readable segments, oldest first; unreadable files are skipped."""
        out = []
        with os.scandir(self.root) as it:
            names = [e.name for e in it]
        for name in names:
            m = SEGMENT_RE.fullmatch(name)
            if not m:
                continue
            try:
                out.append(self.info(m[1]))
            except TensorRefError:
                continue  # vanished or corrupt
        out.sort(key=lambda s: s.created_at)
        return out

    def gc(self, now: float | None = None, finished: Collection[str] = ()) -> list[str]:
        """Reclaim what is stale at ``now`` (epoch seconds, default: the current time):
        segments past their TTL or lease (:mod:`shared.transport.lifetime`) or whose owner
        died, segments bound to a request of ``finished`` (ids of requests known to have
        their final result: ``fleet shm gc``, ``fleet down``), unreadable segment files older
        than ``default_ttl_s``, temp files of writers that died or stalled longer than that,
        and pool files idle past ``recycle_idle_s``.

        Returns:
            Segment ids, and the names of temp (``.tmp-``) and pool (``.pool-``) files.

        Safe to run concurrently with readers (their mappings stay valid) and with writers.
        """
        now = time.time() if now is None else now
        removed: list[str] = []
        with os.scandir(self.root) as it:
            entries = list(it)
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue  # never follow or delete anything we did not create
            gone = self._stale(entry.name, st, now, finished)
            if gone is not None:
                unlink_quiet(self.root / entry.name)
                removed.append(gone)
        if removed:
            log.info("shm gc removed %d file(s) from %s", len(removed), self.root)
        return removed

    def _stale(
        self, name: str, st: os.stat_result, now: float, finished: Collection[str]
    ) -> str | None:
        """What to report when the file ``name`` is stale (its id or name), else None."""
        if m := SEGMENT_RE.fullmatch(name):
            try:
                meta, _, mtime = self.read_meta(m[1])
                expires = meta.leased_until(mtime, self.reader.max_lifetime_s)
                done = bool(meta.request) and meta.request in finished
                stale = done or now >= expires or not owner_alive(meta)
            except TensorRefError:
                stale = now - st.st_mtime > self.default_ttl_s  # corrupt: give it time
            return m[1] if stale else None
        if POOL_RE.fullmatch(name):
            return name if self.pool.idle(st, now) else None
        if m := TMP_RE.fullmatch(name):
            writer_pid, host = int(m[2]), m[3]
            dead = host == hostname() and not pid_alive(writer_pid)
            return name if dead or now - st.st_mtime > self.default_ttl_s else None
        return None
