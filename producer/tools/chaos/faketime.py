"""One process's wall clock skewed, the machine's and Redis' untouched (libfaketime).

Why: a host whose clock is off is a fault the fleet must survive (``shared.clock``); the
drill and its test reproduce it for real, on one worker process: libfaketime, preloaded,
offsets what ``clock_gettime(CLOCK_REALTIME)`` and friends return to that process (Python's
``time.time()``, ``datetime.now()``, its log lines) while the monotonic clock stays true
(``FAKETIME_DONT_FAKE_MONOTONIC=1``: timeouts and waits must still work).

libfaketime 0.9.10 (Debian 12's) mishandles ``clock_nanosleep(CLOCK_MONOTONIC,
TIMER_ABSTIME)`` with the monotonic clock excluded: it shifts the absolute monotonic wake-up
time by the offset, so the kernel answers ``EINVAL`` (+1 h) or sleeps an hour (-1 h)
(wolfcw/libfaketime#426). Python 3.11's ``time.sleep`` sleeps exactly that way, so every
``time.sleep`` in a skewed worker failed. A shim preloaded before libfaketime passes
monotonic sleeps straight to the kernel (they need no faking: that clock is not faked) and
everything else to libfaketime; it is built once from the C source below with the
system's ``cc`` (faking the monotonic clock too is no way out: Python's lock and condition
timeouts then wait an hour). :func:`skewed_env` raises :class:`FaketimeUnavailable`, with the
reason, where either is missing.

The same libfaketime creates a shared-memory segment and a semaphore in /dev/shm for every
process it is preloaded into (``faketime_shm_<pid>``, ``sem.faketime_sem_<pid>``) and leaves
both when the process ends, however it ends: :func:`sweep` removes those of ended processes;
whoever started skewed processes calls it once they are gone.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["LIBFAKETIME_PATHS", "FaketimeUnavailable", "find_libfaketime", "skewed_env", "sweep"]

SHM_DIR = Path("/dev/shm")
_LEFT_BEHIND = ("faketime_shm_", "sem.faketime_sem_")  # + the pid of the process it was in

LIBFAKETIME_PATHS = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)

_SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Monotonic sleeps straight to the kernel (that clock is not faked); the rest to the next
   definition: libfaketime's, preloaded after this one. */
int clock_nanosleep(clockid_t clock_id, int flags, const struct timespec *req,
                    struct timespec *rem) {
    if (clock_id == CLOCK_MONOTONIC) {
        return syscall(SYS_clock_nanosleep, clock_id, flags, req, rem) == 0 ? 0 : errno;
    }
    static int (*next)(clockid_t, int, const struct timespec *, struct timespec *);
    if (!next) {
        next = dlsym(RTLD_NEXT, "clock_nanosleep");
    }
    return next(clock_id, flags, req, rem);
}
"""


class FaketimeUnavailable(RuntimeError):
    """libfaketime or the C compiler its shim is built with is missing (the message says
    which, and what to install)."""


def find_libfaketime() -> Path | None:
    """libfaketime's preload library (``FLEET_LIBFAKETIME`` wins), or ``None``."""
    named = os.environ.get("FLEET_LIBFAKETIME")
    for candidate in ([named] if named else []) + list(LIBFAKETIME_PATHS):
        if Path(candidate).is_file():
            return Path(candidate)
    return None


def _shim(build_dir: Path) -> Path:
    """The shim's shared object under ``build_dir``, built on first use.

    Raises:
        FaketimeUnavailable: no ``cc``, or it failed.
    """
    digest = hashlib.sha256(_SHIM_C.encode()).hexdigest()[:12]
    out = build_dir / f"faketime-sleep-shim-{digest}.so"
    if out.is_file():
        return out
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise FaketimeUnavailable(
            "no C compiler (cc) to build the clock_nanosleep shim libfaketime 0.9.10 needs "
            "under Python 3.11: apt-get install gcc"
        )
    build_dir.mkdir(parents=True, exist_ok=True)
    src = build_dir / f"faketime-sleep-shim-{digest}.c"
    src.write_text(_SHIM_C)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    done = subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-o", str(tmp), str(src), "-ldl"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise FaketimeUnavailable(f"building the faketime shim failed: {done.stderr.strip()}")
    tmp.replace(out)  # atomic: a concurrent build never preloads half a file
    return out


def skewed_env(offset_s: float, build_dir: Path) -> dict[str, str]:
    """Environment variables that start a process with its wall clock ``offset_s`` seconds
    off (``+3600``: an hour ahead) and its monotonic clock true; any ``LD_PRELOAD`` of the
    caller's environment is kept after them.

    Raises:
        FaketimeUnavailable: libfaketime is not installed (``apt-get install libfaketime``)
            or its shim cannot be built.
    """
    lib = find_libfaketime()
    if lib is None:
        raise FaketimeUnavailable(
            "libfaketime is not installed (apt-get install libfaketime; or FLEET_LIBFAKETIME "
            "naming its libfaketime.so.1)"
        )
    preload = [str(_shim(build_dir)), str(lib)]
    if os.environ.get("LD_PRELOAD"):
        preload.append(os.environ["LD_PRELOAD"])
    return {
        "LD_PRELOAD": ":".join(preload),
        "FAKETIME": f"{offset_s:+.0f}",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def sweep(shm_dir: Path = SHM_DIR) -> int:
    """Remove the segments libfaketime left in ``shm_dir`` for processes of this user that
    have ended (see the module docstring); a live process's stay. Returns how many went."""
    removed = 0
    uid = os.getuid()
    for prefix in _LEFT_BEHIND:
        for path in shm_dir.glob(f"{prefix}*"):
            pid = path.name.removeprefix(prefix)
            try:
                if not pid.isdigit() or path.stat().st_uid != uid or _alive(int(pid)):
                    continue
                path.unlink()
            except FileNotFoundError:
                continue
            removed += 1
    return removed
