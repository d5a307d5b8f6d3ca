"""Locks on segment files, the housekeeping thread, and what a fork does to both.

- ``flock`` helpers: a lock belongs to the *open file description*, so every descriptor
  dup'ed from it (Python's ``mmap`` keeps one) and every forked child's copy shares it; it
  goes with an explicit unlock on any of them or with the description's last reference.
  Readers hold a shared lock for as long as a view of a file lives; a producer rewrites a
  pool file only under an exclusive lock taken without waiting (:mod:`.pool`).
- :class:`Sweeper`: a daemon thread that runs an owner's housekeeping while there is some.
- Fork: the package's one ``os.register_at_fork``. Objects whose state a forked child must not
  inherit as is (descriptors carrying locks, their own locks, threads) subclass
  :class:`ForkAware` and call :func:`watch_fork`. Before a fork their ``before_fork`` runs in
  ascending ``fork_rank`` (a lock taken while another is held gets the higher rank, so the
  forking thread takes them in the order every other thread does); after it the other hooks
  run in descending rank, on the objects the before-hooks saw.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from contextlib import suppress
from typing import ClassVar

__all__ = [
    "ForkAware",
    "Sweeper",
    "lock_exclusive",
    "lock_shared",
    "unlock",
    "unmap_and_close",
    "watch_fork",
]


def _try_flock(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def lock_shared(fd: int) -> bool:
    """Take a shared ``flock`` on ``fd``'s open file description without waiting.

    Returns False when a writer holds the exclusive lock (the file is being rewritten).
    """
    return _try_flock(fd, fcntl.LOCK_SH)


def lock_exclusive(fd: int) -> bool:
    """Take an exclusive ``flock`` on ``fd``'s open file description without waiting.

    Returns False when any other description holds a lock (a reader has a live view). A failed
    attempt leaves ``fd`` with no lock at all (``flock`` drops a held lock before converting).
    """
    return _try_flock(fd, fcntl.LOCK_EX)


def unlock(fd: int) -> None:
    """Drop ``fd``'s ``flock`` (a no-op when it holds none)."""
    fcntl.flock(fd, fcntl.LOCK_UN)


def unmap_and_close(mm: mmap.mmap, fd: int) -> None:
    """Unmap ``mm`` and close ``fd`` (call once). A buffer still exported from the mapping (an
    exception's frame may hold one) keeps it mapped until collected; the descriptor, and any
    flock it carries, goes now either way."""
    with suppress(BufferError):
        mm.close()
    os.close(fd)


class Sweeper:
    """Calls ``sweep`` every ``interval_s`` on a daemon thread, under ``lock``, for as long as
    it returns True (something is left to watch); :meth:`ensure` starts it again.

    Args:
        sweep: the owner's housekeeping (a bound method, held weakly: the thread does not keep
            its owner alive, and ends once the owner is collected); returns whether to keep
            sweeping.
        interval_s: seconds between calls.
        lock: the owner's lock (reentrant); the decision to stop is taken under it, so an
            :meth:`ensure` under the same lock never finds a thread that is about to end.
        name: the thread's name.
    """

    def __init__(
        self, sweep: Callable[[], bool], interval_s: float, lock: threading.RLock, name: str
    ) -> None:
        self._sweep = weakref.WeakMethod(sweep)  # type: ignore[arg-type]
        self.interval_s = float(interval_s)
        self.lock = lock
        self.name = name
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def ensure(self) -> None:
        """Start the thread unless it runs (call with the owner's lock held)."""
        if self._thread is not None and self._thread.is_alive() and not self._stop.is_set():
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(self._stop,), name=self.name, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Tell the thread to end (it does within ``interval_s``)."""
        self._stop.set()

    def reset_after_fork(self, lock: threading.RLock) -> None:
        """In a forked child: no thread runs there; use the child's new owner lock."""
        self.lock = lock
        self._thread = None
        self._stop = threading.Event()

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval_s):
            with self.lock:
                sweep = self._sweep()
                if sweep is None or not sweep():
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
                del sweep  # no strong reference to the owner between ticks


class ForkAware:
    """Base of objects with fork hooks (see the module docstring); the hooks do nothing
    unless overridden. Register an instance with :func:`watch_fork`."""

    fork_rank: ClassVar[int] = 1

    def before_fork(self) -> None:
        """In the forking thread, before the fork."""

    def after_fork_in_parent(self) -> None:
        """In the parent, after the fork."""

    def after_fork_in_child(self) -> None:
        """In the child (only the forking thread goes on there), after the fork."""


_watched: weakref.WeakSet[ForkAware] = weakref.WeakSet()
# By forking thread: the objects whose before_fork ran for the fork under way. The hooks may
# wait for locks, and other threads run (and create objects, or fork) meanwhile: the after
# hooks run on this list, never on objects whose before_fork did not run. (The forking thread
# keeps its ident in the child.)
_forking: dict[int, list[ForkAware]] = {}


def watch_fork(obj: ForkAware) -> None:
    """Run ``obj``'s fork hooks around every fork of this process while ``obj`` lives."""
    _watched.add(obj)


def _before_fork() -> None:
    objs = _forking[threading.get_ident()] = sorted(_watched, key=lambda o: o.fork_rank)
    for obj in objs:
        obj.before_fork()


def _after_fork_in_parent() -> None:
    for obj in reversed(_forking.pop(threading.get_ident(), [])):
        obj.after_fork_in_parent()


def _after_fork_in_child() -> None:
    objs = _forking.pop(threading.get_ident(), [])
    _forking.clear()  # other threads' forks do not go on in this process
    for obj in reversed(objs):
        obj.after_fork_in_child()


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)
