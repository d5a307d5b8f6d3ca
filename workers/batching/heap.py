"""The worker process's heap: short garbage-collector pauses, and freed memory given back.

Garbage collector
-----------------
After start a worker holds a large, long-lived object graph (torch and its operators, the
tokenizer, Celery and kombu, the model's modules). CPython's full collection (generation
2) walks every tracked object with the GIL held, on whichever thread allocated past the
threshold, usually the event loop's: no message is read, admitted or acked while it runs,
so a REALTIME request arriving then waits the whole pause, however idle its lane (the
tail this fixes is in ``docs/measurements/``, "REALTIME tail"). :func:`freeze_startup_heap`,
called once the worker is ready, collects once and then moves everything alive into the
permanent generation (``gc.freeze``, CPython >= 3.7; what Instagram's and gunicorn's
users do for the same reason): later full collections walk only what was allocated
since. Cycles among frozen objects are never collected, which is what we want of objects
that live as long as the process.

:class:`GcPauses` times every collection (``gc.callbacks``) and keeps per-generation
counts, total and longest pause, for the worker's stats. The callback only adds to plain
numbers: it runs inside whatever code triggered the collection, so it must take no lock
that code might hold (prometheus_client's metric locks are not reentrant).

malloc_trim
-----------
:func:`trim` returns freed heap pages to the OS (glibc ``malloc_trim``; a no-op
elsewhere): batches of varying shapes leave glibc holding freed arenas, so the worker's
RSS creeps up over a long run. A fixed ``MALLOC_MMAP_THRESHOLD_`` would cure that but
sends every tensor buffer through mmap/munmap (system time); an occasional trim is cheap.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import time
from typing import Any

__all__ = ["PAUSES", "GcPauses", "freeze_startup_heap", "trim"]


def freeze_startup_heap() -> int:
    """Collect once, then exempt every object alive now from later collections.

    Returns:
        How many objects are frozen (``gc.get_freeze_count()``).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Per-generation collection counts and pause times (seconds) of this process, since
    :meth:`reset`."""

    def __init__(self) -> None:
        self.reset()
        self._t0 = 0.0
        self._installed = False

    def reset(self) -> None:
        """Forget what was counted so far (the worker resets once ready: startup's
        collections, over a heap still growing, are not serving pauses)."""
        self.count = [0, 0, 0]
        self.total_s = [0.0, 0.0, 0.0]
        self.max_s = [0.0, 0.0, 0.0]

    def install(self) -> None:
        """Start timing collections (idempotent)."""
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._on_gc)
            self._installed = False

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        gen = info.get("generation", 2)
        dt = time.perf_counter() - self._t0
        self.count[gen] += 1
        self.total_s[gen] += dt
        if dt > self.max_s[gen]:
            self.max_s[gen] = dt

    def snapshot(self) -> dict[str, Any]:
        """JSON-able: ``frozen`` objects, and per generation ``count``, ``total_s`` and
        ``max_s``."""
        return {
            "frozen": gc.get_freeze_count(),
            "generations": [
                {"count": c, "total_s": round(t, 6), "max_s": round(m, 6)}
                for c, t, m in zip(self.count, self.total_s, self.max_s, strict=True)
            ],
        }


PAUSES = GcPauses()
"""This process's collection pauses (the worker installs it at start, resets it at ready)."""


def trim() -> None:
    """Return freed heap memory to the OS (glibc ``malloc_trim``; a no-op elsewhere)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None
