"""The local stack's processes: started in their own process group with a log and a pidfile
under the run directory, waited for until they answer, stopped by pidfile.

:class:`ProcessTable` is mixed into :class:`producer.stack.local.Stack`; :class:`StackError` is what
a failed start raises. Import these names from ``producer.stack.local``.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shared.procs import running as _alive
from shared.procs import signal_group as _signal_group

__all__ = ["Proc", "ProcessTable", "StackError"]


class StackError(RuntimeError):
    """A stack process failed to start or to answer in time.

    ``str()`` holds the log tail; ``summary`` is one line (what failed, and the log's last
    line) and ``log_path`` the full log, for a command line's short report.
    """

    def __init__(self, message: str, summary: str = "", log_path: Path | None = None) -> None:
        super().__init__(message)
        self.summary = summary or message.splitlines()[0]
        self.log_path = log_path


@dataclass(frozen=True)
class Proc:
    name: str
    pid: int


class ProcessTable:
    """Spawning, waiting for, and stopping the processes of one run directory (mixed into
    :class:`producer.stack.local.Stack`, which sets ``pids``, ``logs`` and ``_log_from`` and gives
    the children's environment, ``env()``)."""

    if TYPE_CHECKING:
        pids: Path
        logs: Path
        _log_from: dict[str, int]

        def env(self) -> dict[str, str]: ...

    def start_process(
        self,
        name: str,
        argv: list[str],
        ready: Callable[[], bool],
        timeout_s: float,
        env: dict[str, str] | None = None,
    ) -> Proc:
        """Start another process of this stack (its log, its pidfile: ``down`` stops it) and
        wait until ``ready()``. Raises StackError when it exits or is not ready in time."""
        proc = self._spawn(name, argv, env)
        self._wait(ready, name, proc, timeout_s)
        return proc

    def stop(self, name: str, timeout_s: float = 20.0) -> None:
        pidfile = self.pids / f"{name}.pid"
        pid = self._read_pid(pidfile)
        if pid is not None and _alive(pid):
            _signal_group(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                _signal_group(pid, signal.SIGKILL)
                while _alive(pid):
                    time.sleep(0.05)
        pidfile.unlink(missing_ok=True)

    def status(self) -> dict[str, bool]:
        if not self.pids.exists():
            return {}
        return {p.stem: self.alive(p.stem) for p in sorted(self.pids.glob("*.pid"))}

    def dead_worker_nodes(self) -> set[str]:
        """Node names (``text-1@<this host>``) of the workers this run dir started whose
        process is gone (a pidfile left, its pid not running): their heartbeat in
        ``fleet:live:*`` may still look fresh for up to ``lease_s``."""
        host = socket.gethostname()
        return {
            f"{name.removeprefix('worker-')}@{host}"
            for name, ok in self.status().items()
            if name.startswith("worker-") and not ok
        }

    def alive(self, name: str) -> bool:
        pid = self._read_pid(self.pids / f"{name}.pid")
        return pid is not None and _alive(pid)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        path = self.logs / f"{name}.log"
        # A failed start shows only what this start wrote, not earlier runs' lines.
        self._log_from[name] = path.stat().st_size if path.exists() else 0
        log = open(path, "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env or self.env(),
            start_new_session=True,  # its own process group: `down` signals the whole group
        )
        log.close()
        (self.pids / f"{name}.pid").write_text(str(proc.pid))
        return Proc(name, proc.pid)

    def _wait(self, check: Callable[[], bool], what: str, proc: Proc, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if check():
                return
            if not _alive(proc.pid):
                raise self._start_error(proc.name, f"{what} exited during start-up")
            time.sleep(0.25)
        raise self._start_error(proc.name, f"{what} did not answer within {timeout_s:.0f} s")

    def _start_error(self, name: str, what: str) -> StackError:
        tail = self.log_tail(name)
        last = next((ln.strip() for ln in reversed(tail.splitlines()) if ln.strip()), "")
        summary = f"{what}: {last}" if last and last != "(no log)" else what
        return StackError(f"{what}:\n{tail}", summary, self.logs / f"{name}.log")

    def log_tail(self, name: str, lines: int = 30) -> str:
        """The last ``lines`` of ``name``'s log written since this object last started it
        (the whole file for a process another ``Stack`` started)."""
        path = self.logs / f"{name}.log"
        if not path.exists():
            return "(no log)"
        with path.open("rb") as f:
            f.seek(self._log_from.get(name, 0))
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:]) or "(nothing logged)"

    @staticmethod
    def _read_pid(path: Path) -> int | None:
        try:
            return int(path.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
