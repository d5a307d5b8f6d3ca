"""The write path of a put: reserve a file under the root lock, write the segment into it, and
publish it under its id.

A published segment is never truncated or rewritten (only unlinked), and new pages are only
ever written through ``write()`` into a file reserved under the lock, never through a mapping:
a full /dev/shm shows up as ENOSPC (:class:`~shared.errors.ShmCapacityError`), not as SIGBUS
in a writer or a reader. (A recycling store writes through a mapping only into pages that are
allocated already: :mod:`.pool`.) The temp file is sized at once (``ftruncate`` to the exact
IPC size) so that concurrent puts count it in the budget while its data is written outside
the lock; it is published with ``link`` (not ``rename``), which fails instead of replacing an
existing segment, so a segment appears complete or not at all.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ShmCapacityError, TransportError
from shared.transport import segment
from shared.transport.locks import unlock
from shared.transport.pool import Kept, KeptMappings, Pool
from shared.transport.root import RootLock, fmt_bytes, tmp_path, unlink_quiet

__all__ = ["Reservation", "publish", "reserve", "write"]

_CREATE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class Reservation:
    """A temp file reserved for one segment.

    ``fd``: its descriptor (-1 once a writer owns it); ``size``: its size in bytes;
    ``claimed``: a pool file (it holds the exclusive lock until written); ``kept``: the writer's
    kept mapping of it, written through instead of ``fd``; ``keep_fd``: a descriptor to map
    and keep after the write.
    """

    seg_id: str
    tmp: Path
    fd: int
    size: int
    claimed: bool = False
    kept: Kept | None = None
    keep_fd: int | None = None

    def abandon(self) -> None:
        """Close what it holds and remove the temp file."""
        if self.kept is not None:
            self.kept.close()  # its descriptor is fd: closed once, here
        elif self.fd >= 0:
            os.close(self.fd)
        self.fd = -1
        if self.keep_fd is not None:
            os.close(self.keep_fd)
            self.keep_fd = None
        unlink_quiet(self.tmp)


def reserve(
    lock: RootLock, pool: Pool | None, seg_id: str, size: int, ensure_room: Callable[[int], None]
) -> Reservation:
    """A file of ``size`` bytes for segment ``seg_id``: a claimed pool file of about that size
    (when ``pool`` is given and has one: only what it lacks is new to the budget), else a new
    one. ``ensure_room(n)`` raises unless ``n`` more bytes fit; it runs under the root lock.

    Raises:
        ShmCapacityError: from ``ensure_room``; nothing is left behind.
        OSError: creating or sizing the file failed; nothing is left behind.
    """
    tmp = tmp_path(lock.root, seg_id)
    with lock.held():
        claim = pool.claim(size, tmp) if pool is not None else None
        if claim is None:
            ensure_room(size)
            res = Reservation(seg_id, tmp, os.open(tmp, _CREATE, 0o600), size)
        else:
            res = Reservation(seg_id, tmp, claim.fd, size, claimed=True, kept=claim.kept)
        try:
            if claim is not None:
                # The claimed file is in the budget already (pool files count), but it may
                # have been pooled by a store with a larger budget: check anyway.
                ensure_room(max(0, size - claim.size))
            if res.kept is None:
                os.fchmod(res.fd, 0o600)  # exact mode whatever the umask
                os.ftruncate(res.fd, size)
        except BaseException:
            res.abandon()
            raise
    return res


def write(res: Reservation, enc: segment.Encoded, keep: bool) -> None:
    """Write ``enc`` into the reserved file: through its kept mapping when it has one, else
    with ``write()`` (and, when ``keep``, a descriptor is kept to map the file afterwards).
    The claim's lock ends with the write, before the segment is published (no reader can open
    the temp name meanwhile).

    Raises:
        ShmCapacityError: no space left; nothing is left behind.
        TransportError: any other I/O failure; nothing is left behind.
    """
    with _abandoned_on_error(res):
        if res.kept is not None:
            segment.write_ipc_mapped(res.kept.mm, res.kept.size, enc)
            unlock(res.kept.fd)
            return
        fd, res.fd = res.fd, -1  # the file object (or this block) closes it from here on
        try:
            # A claimed file's description may be one this store kept, its offset at the end
            # of an earlier write: the IPC file starts at byte 0.
            os.lseek(fd, 0, os.SEEK_SET)
            if keep:
                res.keep_fd = os.dup(fd)  # the same description, kept with a mapping
            f = os.fdopen(fd, "wb")  # buffered: write() loops over short writes
        except BaseException:
            os.close(fd)
            raise
        with f:
            segment.write_ipc(f, enc.schema, enc.batch)
            f.flush()
            written = f.tell()
            if written != res.size:  # never expected; keep the footer at the file's end
                os.ftruncate(f.fileno(), written)
                res.size = written
            if res.claimed:
                # Explicitly, not by the close: a child forked meanwhile holds a copy of this
                # description, and with it the lock, until it exits.
                unlock(f.fileno())


def publish(res: Reservation, final: Path, kept: KeptMappings) -> None:
    """Link the written file under its segment name, remove the temp name, and hand the
    file's mapping (kept, or to be made from ``keep_fd``) to ``kept``.

    Raises:
        TransportError: the link failed (e.g. the id exists); nothing is left behind.
    """
    with _abandoned_on_error(res):
        os.link(res.tmp, final)
    unlink_quiet(res.tmp)
    if res.kept is not None:
        kept.remember(res.kept)
    elif res.keep_fd is not None:
        kept.keep(res.keep_fd, res.size)
    res.kept = res.keep_fd = None


@contextmanager
def _abandoned_on_error(res: Reservation) -> Iterator[None]:
    """Abandon ``res`` when the block fails; an I/O failure becomes a fleet error."""
    try:
        yield
    except BaseException as exc:
        res.abandon()
        if _is_enospc(exc):
            raise ShmCapacityError(
                f"no space left in {res.tmp.parent.parent} while writing "
                f"{fmt_bytes(res.size)}; nothing was kept"
            ) from None
        if isinstance(exc, OSError):
            raise TransportError(f"writing segment {res.seg_id} failed: {exc}") from exc
        raise


def _is_enospc(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # pyarrow may re-raise a Python write error as its own OSError subclass without errno.
    return isinstance(exc, OSError) and "No space left on device" in str(exc)
