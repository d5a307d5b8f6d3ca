"""Warmup planning (``workers/warmup.py``): what is warmed before ready, what later."""

from __future__ import annotations

import threading

from workers.warmup import WarmQueue, WarmStep, split_plan, warm_plan


def test_plan_warms_each_bucket_at_one_and_its_largest_size() -> None:
    largest = {"len8": 32, "len64": 32, "len256": 10, "len1": 1}
    plan = warm_plan(["len8", "len64", "len256", "len1"], lambda b: largest[b])
    assert plan == [
        [WarmStep("len8", 1), WarmStep("len8", 32)],
        [WarmStep("len64", 1), WarmStep("len64", 32)],
        [WarmStep("len256", 1), WarmStep("len256", 10)],
        [WarmStep("len1", 1)],  # largest 1: one step, not two
    ]
    assert warm_plan([None], lambda b: 0) == [[WarmStep(None, 1)]]  # at least size 1


def test_split_keeps_the_shortest_buckets_before_ready() -> None:
    plan = warm_plan(["a", "b", "c"], lambda b: 4)
    first, rest = split_plan(plan, 2)
    assert [s.bucket for s in first] == ["a", "a", "b", "b"]
    assert [s.bucket for s in rest] == ["c", "c"]
    assert split_plan(plan, 0) == ([], [s for steps in plan for s in steps])
    assert split_plan(plan, 99) == ([s for steps in plan for s in steps], [])
    assert split_plan(plan, None)[1] == []  # no idle thread (baseline): all before ready


def test_queue_runs_each_step_once_across_threads() -> None:
    steps = [WarmStep(str(i), 1) for i in range(50)]
    q = WarmQueue(steps)
    ran: list[WarmStep] = []
    lock = threading.Lock()

    def run(step: WarmStep) -> None:
        with lock:
            ran.append(step)

    def drain() -> None:
        while q.run_one(run):
            pass

    threads = [threading.Thread(target=drain) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(ran, key=lambda s: int(s.bucket or 0)) == steps
    assert q.done == 50 and len(q) == 0 and not q.run_one(run)
