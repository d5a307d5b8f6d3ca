"""Redis's AOF on a small tmpfs that a drill fills: the disk-full fault (``fleet chaos`` fault
``disk_full``, ``tests/integration/test_write_refusals.py``).

Redis appends every write to its AOF. When an append fails (``ENOSPC``) it keeps the data in
memory and answers every later write, and ``PING``, with ``MISCONF Errors writing to the AOF
file: No space left on device``; reads still work. It retries the append every second by
itself and accepts writes again as soon as one succeeds. That is what an operator meets
when the disk under Redis fills up, and what the workers must live through.

The stack's Redis writes its AOF to its run directory, on the host's disk, which a drill
must not fill. :class:`AofOnTmpfs` moves the AOF to a tmpfs of its own for the drill: it
mounts one, points Redis at it (``CONFIG SET dir``; ``appendonly`` off and on again, so
Redis rewrites the whole AOF there), and on exit moves it back the same way (the AOF in the
run directory is rewritten whole, with every write made meanwhile) and unmounts it.
:meth:`AofOnTmpfs.fill` fills the tmpfs and returns once Redis refuses writes;
:meth:`AofOnTmpfs.free` removes the filler and returns once Redis accepts them again.

Needs ``mount`` (root, or a container with ``CAP_SYS_ADMIN``): :class:`MountRefused`
otherwise. Redis 7 protects ``dir`` (``enable-protected-configs``): :class:`MountRefused`
says so; the stack's Redis (6.2 from the venv) does not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

__all__ = ["AofOnTmpfs", "MountRefused"]

log = logging.getLogger("fleet.chaos")

PROBE_KEY = "fleet:chaos:aof-probe"  # written by the drill to learn when writes are refused
_FILL_CHUNK = 1 << 20


class MountRefused(RuntimeError):
    """The drill cannot put Redis's AOF on a tmpfs here (no mount permission, Redis 7's
    protected ``dir``): the reason is the message."""


class AofOnTmpfs:
    """Redis (``admin``: a client allowed ``CONFIG``) writing its AOF to a tmpfs of
    ``size_mb`` (at least 4 MiB more than the AOF needs), for the ``with`` block.

    Thread safety: one thread drives it.
    """

    def __init__(self, admin: redis.Redis, size_mb: int | None = None) -> None:
        self.admin = admin
        self.size_mb = size_mb
        self.mount: Path | None = None
        self._old_dir = ""
        self._filler: Path | None = None

    # -- the block ----------------------------------------------------------------------
    def __enter__(self) -> AofOnTmpfs:
        self._old_dir = str(self.admin.config_get("dir")["dir"])
        size = self.size_mb or self._size_needed_mb()
        mount = Path(tempfile.mkdtemp(prefix="fleet-aof-tmpfs-"))
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}m,mode=0700", "tmpfs", str(mount)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            mount.rmdir()
            raise MountRefused(f"cannot mount a tmpfs for the AOF: {done.stderr.strip()}")
        self.mount = mount
        try:
            self._move_aof(str(mount))
        except BaseException:
            self._unmount()
            raise
        log.info("redis AOF on a %d MiB tmpfs at %s", size, mount)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._filler is not None:
                self.free()
            self._move_aof(self._old_dir)
        finally:
            self._unmount()

    # -- the fault ----------------------------------------------------------------------
    def fill(self, timeout_s: float = 20.0) -> None:
        """Fill the tmpfs; return once Redis refuses a write with ``MISCONF`` (it notices at
        its next append: the drill writes a probe key until then).

        Raises:
            TimeoutError: Redis still accepts writes after ``timeout_s``.
        """
        assert self.mount is not None, "fill() inside the with block"
        self._filler = self.mount / "filler"
        fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for chunk in (_FILL_CHUNK, 4096, 1):  # to the last byte the tmpfs has
                with contextlib.suppress(OSError):
                    while True:
                        os.write(fd, b"\0" * chunk)
        finally:
            os.close(fd)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.refused():
                return
            time.sleep(0.05)
        raise TimeoutError(f"Redis still accepts writes {timeout_s:.0f} s after its disk filled")

    def free(self, timeout_s: float = 20.0) -> None:
        """Remove the filler; return once Redis accepts a write again.

        Raises:
            TimeoutError: Redis still refuses writes after ``timeout_s``.
        """
        if self._filler is not None:
            self._filler.unlink(missing_ok=True)
            self._filler = None
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if not self.refused():
                return
            time.sleep(0.05)
        raise TimeoutError(f"Redis still refuses writes {timeout_s:.0f} s after space was freed")

    def refused(self) -> bool:
        """Whether Redis refuses a write now (a probe key of 16 KiB: more than a tmpfs page
        holds, so a full tmpfs fails its append)."""
        try:
            self.admin.set(PROBE_KEY, b"\0" * 16384, px=60_000)
        except redis.ResponseError as exc:
            if str(exc).startswith("MISCONF"):
                return True
            raise
        return False

    # -- moving the AOF -----------------------------------------------------------------
    def _size_needed_mb(self) -> int:
        """Room for the rewritten AOF (the dataset, twice over for the rewrite's temporary
        file) and the writes of the drill."""
        info = self.admin.info("memory")
        dataset = int(info.get("used_memory_dataset", info.get("used_memory", 0)))
        return max(16, 2 * dataset // 2**20 + 16)

    def _move_aof(self, directory: str) -> None:
        """Have Redis write its AOF in ``directory`` from now on: appendonly off, ``dir``,
        appendonly on (Redis rewrites the whole AOF there); returns once the rewrite ended.

        Raises:
            MountRefused: Redis refuses ``CONFIG SET dir`` (Redis 7's protected configs).
        """
        r = self.admin
        r.config_set("appendonly", "no")
        try:
            r.config_set("dir", directory)
        except redis.ResponseError as exc:
            r.config_set("appendonly", "yes")
            raise MountRefused(
                f"Redis refuses CONFIG SET dir ({exc}): Redis 7 needs "
                "enable-protected-configs local for this drill"
            ) from exc
        r.config_set("appendonly", "yes")
        end = time.monotonic() + 60
        while time.monotonic() < end:
            p = r.info("persistence")
            if p.get("aof_enabled") and not (
                p.get("aof_rewrite_in_progress") or p.get("aof_rewrite_scheduled")
            ):
                if p.get("aof_last_bgrewrite_status", "ok") != "ok":
                    raise RuntimeError(f"Redis could not rewrite its AOF into {directory}")
                return
            time.sleep(0.05)
        raise TimeoutError(f"Redis did not rewrite its AOF into {directory} within 60 s")

    def _unmount(self) -> None:
        """Unmount the tmpfs (Redis may still close its old AOF file on it for a moment)."""
        if self.mount is None:
            return
        for _ in range(100):
            done = subprocess.run(["umount", str(self.mount)], capture_output=True, text=True)
            if done.returncode == 0:
                break
            time.sleep(0.1)
        else:
            log.warning("could not unmount %s: %s", self.mount, done.stderr.strip())
            return
        shutil.rmtree(self.mount, ignore_errors=True)
        self.mount = None
