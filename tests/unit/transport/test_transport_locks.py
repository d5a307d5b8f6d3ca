"""Tests of shared/transport/locks.py: flock helpers on real files, the Sweeper thread, and
the one fork hook (ForkAware objects, by rank, around real forks)."""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from shared.transport.locks import (
    ForkAware,
    Sweeper,
    lock_exclusive,
    lock_shared,
    unlock,
    watch_fork,
)


@pytest.fixture
def descriptors(tmp_path: Path) -> Iterator[list[int]]:
    """Three open file descriptions of one file."""
    path = tmp_path / "segment"
    path.write_bytes(b"x")
    fds = [os.open(path, os.O_RDONLY) for _ in range(3)]
    yield fds
    for fd in fds:
        os.close(fd)


def test_readers_share_and_a_writer_excludes(descriptors: list[int]) -> None:
    a, b, w = descriptors
    assert lock_shared(a) and lock_shared(b)  # readers with live views
    assert not lock_exclusive(w)  # a producer never rewrites under them
    unlock(a)
    assert not lock_exclusive(w)  # one view is left
    unlock(b)
    assert lock_exclusive(w)
    assert not lock_shared(a)  # the file is being rewritten: a reader is told so
    unlock(w)
    assert lock_shared(a)


class Recorder(ForkAware):
    """Appends ``(hook, name)`` to ``log``; the child's entries come back through a pipe."""

    log: ClassVar[list[tuple[str, str]]] = []

    def __init__(self, name: str, rank: int) -> None:
        self.name, self.fork_rank = name, rank
        watch_fork(self)

    def before_fork(self) -> None:
        self.log.append(("before", self.name))

    def after_fork_in_parent(self) -> None:
        self.log.append(("parent", self.name))

    def after_fork_in_child(self) -> None:
        self.log.append(("child", self.name))


def fork_and_collect() -> tuple[list[list[str]], list[list[str]]]:
    """Fork; returns the hooks recorded in this process and in the child, in order."""
    r, w = os.pipe()
    Recorder.log.clear()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, json.dumps(Recorder.log).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        child = json.loads(f.read())
    os.waitpid(pid, 0)
    return [list(e) for e in Recorder.log], child


def test_fork_hooks_run_by_rank_and_after_hooks_in_reverse() -> None:
    cache, root = Recorder("cache", 1), Recorder("root", 0)  # a root lock ranks first
    parent, child = fork_and_collect()
    before = [["before", "root"], ["before", "cache"]]
    assert parent == [*before, ["parent", "cache"], ["parent", "root"]]
    assert child == [*before, ["child", "cache"], ["child", "root"]]
    del cache, root


def test_an_object_made_during_a_fork_gets_only_whole_forks() -> None:
    made: list[Recorder] = []

    class Maker(Recorder):
        def before_fork(self) -> None:
            super().before_fork()
            if not made:
                made.append(Recorder("late", 0))  # another thread could do this meanwhile

    maker = Maker("maker", 1)
    parent, _ = fork_and_collect()
    assert parent == [["before", "maker"], ["parent", "maker"]]  # no after hook for "late"
    parent, _ = fork_and_collect()
    assert ["before", "late"] in parent and ["parent", "late"] in parent
    del maker, made[:]
    gc.collect()
    parent, _ = fork_and_collect()
    assert parent == []  # objects are watched only while they live


class Owner:
    """Has housekeeping for ``rounds`` sweeps, then none."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.calls = 0
        self.lock = threading.RLock()
        self.sweeper = Sweeper(self.sweep, 0.01, self.lock, "test-sweeper")

    def sweep(self) -> bool:
        self.calls += 1
        return self.calls < self.rounds


def wait_for(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)


def sweeper_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "test-sweeper"]


def test_the_sweeper_runs_while_there_is_work_and_starts_again() -> None:
    owner = Owner(rounds=3)
    with owner.lock:
        owner.sweeper.ensure()
    wait_for(lambda: not sweeper_threads())
    assert owner.calls == 3 and not sweeper_threads()  # stopped when nothing was left
    owner.rounds = 5
    with owner.lock:
        owner.sweeper.ensure()
    wait_for(lambda: not sweeper_threads())
    assert owner.calls == 5


def test_the_sweeper_does_not_keep_its_owner_alive() -> None:
    owner = Owner(rounds=10**9)
    with owner.lock:
        owner.sweeper.ensure()
    deadline = time.monotonic() + 10
    while owner.calls == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert owner.calls > 0 and sweeper_threads()
    del owner
    gc.collect()
    wait_for(lambda: not sweeper_threads())
    assert not sweeper_threads()
