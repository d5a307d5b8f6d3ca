"""Warmup planning (``workers/batching/batcher.py``): what is warmed before ready, what later."""

from __future__ import annotations

import threading

from workers.batching.batcher import WarmQueue, WarmStep, split_plan, warm_plan, warming_pays


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


def test_warming_later_is_skipped_where_new_shapes_cost_no_more_the_first_time() -> None:
    # measured shape of a TorchScript text model on the CPU: only the very first run is slow
    cpu = [(0.075, 0.032), (0.0503, 0.0473), (0.0094, 0.0089), (0.0937, 0.0878)]
    assert warming_pays(cpu) is False


def test_warming_later_pays_where_a_new_shape_is_slow_the_first_time() -> None:
    cuda_like = [(2.5, 0.004), (0.060, 0.0040), (0.0042, 0.0040)]  # one shape 15x: CUDA
    assert warming_pays(cuda_like) is True
    assert warming_pays([(0.1, 0.05), (0.126, 0.1)]) is True  # just over 25 %
    assert warming_pays([(0.1, 0.05), (0.124, 0.1)]) is False  # just under


def test_a_few_ms_of_jitter_on_a_tiny_run_is_not_a_first_run_cost() -> None:
    assert warming_pays([(0.066, 0.028), (0.0086, 0.0060)]) is False  # +43 %, but 2.6 ms
    assert warming_pays([(0.066, 0.028), (0.0160, 0.0060)]) is True  # +10 ms


def test_with_nothing_to_judge_by_the_plan_is_kept() -> None:
    assert warming_pays([]) is True
    assert warming_pays([(3.0, 0.01)]) is True  # only the process's first run: not judged
