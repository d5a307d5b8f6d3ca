"""Processes on this host: whether one is alive, whether it is still the same process, and
signalling its group.

The one home of these checks: the transport (a segment's owner, a writer's temp file), the
local stack (its pidfiles) and the tests use them. Linux: ``/proc`` is read for a process's
state and start time.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["pid_alive", "proc_start_time", "proc_state", "running", "signal_group"]


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` from field 3 (state) on, or None when unreadable."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # Field 2 (comm) may contain spaces and parentheses: split after the last ")".
    close = data.rfind(b")")
    return data[close + 2 :].split() if close >= 0 else None


def proc_state(pid: int) -> str | None:
    """The state letter of ``pid`` (``"R"``, ``"S"``, ``"Z"`` for a zombie, ...), or None when
    the process does not exist or /proc is unavailable."""
    fields = _stat_fields(pid)
    return fields[0].decode(errors="replace") if fields else None


def proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22).

    Returns None when the process does not exist or /proc is unavailable.
    """
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None  # field 22 is the 20th from field 3
    except (ValueError, IndexError):
        return None


def pid_alive(pid: int, start_time: int | None = None) -> bool:
    """Whether process ``pid`` still exists and is the same process.

    ``pid <= 0`` counts as alive: ``os.kill(0, 0)`` would probe our own process group. A
    zombie counts as alive until its parent reaps it (its pid is still taken). When
    ``start_time`` is given and the live process at ``pid`` started at another time, the
    pid was recycled: dead.
    """
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, belongs to another user
    if start_time is not None:
        current = proc_start_time(pid)
        if current is not None and current != start_time:
            return False
    return True


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a process that exited and is not reaped).

    A zombie child of this process is reaped here (so it also stops answering signals).
    ``pid <= 0`` is never running.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, belongs to another user
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child
        state = proc_state(pid)
        return state is not None and state != "Z"
    return done == 0


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group led by ``pid``, else to ``pid`` alone; a process that
    is gone already is no error."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
