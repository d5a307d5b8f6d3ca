"""Tests of shared.procs: process liveness on this host, against real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from shared.procs import pid_alive, proc_start_time, proc_state, running, signal_group


def _exited_child() -> int:
    """A child of ours that has exited and is not reaped yet (a zombie)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 10
    while proc_state(pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc_state(pid) == "Z"
    return pid


def test_pid_reuse_detected() -> None:
    me = os.getpid()
    start = proc_start_time(me)
    assert start is not None
    assert pid_alive(me, start)
    assert not pid_alive(me, start + 1)  # same pid, another process start
    assert pid_alive(0) and pid_alive(-1)  # never probe process groups


def test_a_zombie_is_alive_but_not_running_and_is_reaped() -> None:
    pid = _exited_child()
    assert pid_alive(pid)  # its pid is still taken: a segment it owns is not orphaned yet
    assert not running(pid)  # ... but it runs no more, and running() reaped it
    assert proc_state(pid) is None and not pid_alive(pid)
    assert proc_start_time(pid) is None


def test_running_and_signal_group() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        assert running(proc.pid) and proc_state(proc.pid) in {"R", "S", "D"}
        signal_group(proc.pid, signal.SIGTERM)  # the group it leads
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert not running(proc.pid) and not running(0)
