"""workers.batching.batcher with real threads and the real kernel scheduler: while REALTIME traffic
flows the MAIN lane's batches run on a thread of Linux's SCHED_IDLE class (any normal
thread preempts it), and otherwise on the MAIN thread itself at normal class."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import pytest

from shared.schema import Priority
from shared.settings import DeviceConfig
from workers.batching.batcher import Batcher, Lanes, Pending, Policy
from workers.models.runtime import DeviceRuntime

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's"
)


class Seen:
    """What each batch ran on: its first request's id -> (thread name, policy)."""

    def __init__(self) -> None:
        self.runs: dict[str, tuple[str, int]] = {}
        self.done = threading.Condition()

    def run(self, works: list[Any], _trigger: object) -> None:
        with self.done:
            self.runs[works[0]] = (threading.current_thread().name, os.sched_getscheduler(0))
            self.done.notify_all()

    def wait(self, rid: str) -> tuple[str, int]:
        with self.done:
            assert self.done.wait_for(lambda: rid in self.runs, timeout=5), self.runs
            return self.runs[rid]


def lanes(idle_while_realtime: bool = True) -> tuple[Lanes, Seen]:
    seen = Seen()
    policy = Policy(max_batch_size=4, max_queue_delay_ms=0.0, realtime_lane=True)
    ln = Lanes(
        Batcher(policy),
        DeviceRuntime(DeviceConfig(main_lane_nice=0), lanes=2),
        run=seen.run,
        crashed=lambda batch: None,
        expire=lambda expired: None,
        warm_step=lambda step: None,
        idle_while_realtime=idle_while_realtime,
    )
    ln.start()
    return ln, seen


def hold(ln: Lanes, rid: str, priority: Priority) -> None:
    p = Pending(rid, priority, time.monotonic(), None, "b", item=rid)
    with ln.lock:
        ln.hold(p)


def test_main_batches_run_idle_class_only_while_realtime_flows() -> None:
    ln, seen = lanes()
    try:
        hold(ln, "bulk-before", Priority.BULK)
        assert seen.wait("bulk-before") == ("fleet-main", os.SCHED_OTHER)

        hold(ln, "rt", Priority.REALTIME)
        assert seen.wait("rt") == ("fleet-realtime", os.SCHED_OTHER)
        hold(ln, "bulk-during", Priority.BULK)
        assert seen.wait("bulk-during") == ("fleet-main-idle", os.SCHED_IDLE)
        assert ln.idle is not None and ln.idle.idle_class and ln.idle.batches == 1
    finally:
        ln.stop(time.monotonic())


def test_without_the_option_main_batches_stay_on_the_main_thread() -> None:
    ln, seen = lanes(idle_while_realtime=False)
    try:
        hold(ln, "rt", Priority.REALTIME)
        seen.wait("rt")
        hold(ln, "bulk-during", Priority.BULK)
        assert seen.wait("bulk-during") == ("fleet-main", os.SCHED_OTHER)
        assert ln.idle is None
    finally:
        ln.stop(time.monotonic())
