"""What each check runs inside its spawned child: a started ``DeviceRuntime`` on ``cuda:0``.

Every function here returns a dict of plain figures (MiB, ms, GB/s, ratios) that the parent
judges in ``checks.py``; each must stay module-level so that ``spawn`` can pickle it.
``torch`` and the worker runtime are imported inside the functions, never in the parent.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

MiB = 2**20


def _runtime(fraction: float, arena_mb: int = 64) -> Any:
    from shared.settings import DeviceConfig
    from workers.models.runtime import DeviceRuntime

    rt = DeviceRuntime(DeviceConfig(device="cuda:0", memory_fraction=fraction, arena_mb=arena_mb))
    rt.start()
    return rt


def _to_device(rt: Any, tensors: list[Any]) -> list[Any]:
    """Inputs onto the device through the runtime's staging arena when it has one."""
    stage = getattr(rt, "stage", None)
    if stage is not None:
        return list(stage(tensors))
    return [t.to(rt.device, non_blocking=True) for t in tensors]


def _mlp(rt: Any, width: int = 512) -> Any:
    import torch

    model = torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width),
        torch.nn.GELU(),
        torch.nn.Linear(4 * width, width),
        torch.nn.LayerNorm(width),
    )
    return model.to(rt.device).eval()


def _cnn(rt: Any) -> Any:
    import torch

    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1),
        torch.nn.BatchNorm2d(64),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(64, 256),
    )
    return model.to(rt.device).eval()


def _child_stream(barrier: Any) -> dict[str, Any]:
    import torch

    rt = _runtime(0.2)
    barrier.wait(timeout=60)  # both processes hold their runtime at the same time
    default = torch.cuda.default_stream(rt.device)
    with rt.batch_context():
        current = torch.cuda.current_stream(rt.device)
        x = torch.ones(1024, device=rt.device) * 2  # some work on the worker's stream
    on_own = current == rt.stream
    s = rt.stats()
    barrier.wait(timeout=60)
    return {
        "pid": os.getpid(),
        "stream": int(rt.stream.cuda_stream),
        "default_stream": int(default.cuda_stream),
        "current_in_batch_is_own": bool(on_own),
        "stats_stream": s.get("stream"),
        "result_ok": float(x.sum().item()) == 2048.0,
    }


def _child_fraction(fraction: float, chunk_mb: int) -> dict[str, Any]:
    import torch

    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    rt = _runtime(fraction)
    dev = rt.device
    total = torch.cuda.get_device_properties(dev).total_memory
    limit = fraction * total
    # One allocation past the fraction must raise.
    one_shot_raised = False
    try:
        big = torch.empty(int(limit * 1.05), dtype=torch.uint8, device=dev)
        del big
    except oom:
        one_shot_raised = True
    torch.cuda.empty_cache()
    # Filling it chunk by chunk must raise before reserved memory passes the fraction.
    held = []
    fill_raised = False
    cap = 3 * limit  # if the fraction were not enforced, stop well before the GPU is full
    try:
        while torch.cuda.memory_reserved(dev) < cap:
            held.append(torch.empty(chunk_mb * MiB, dtype=torch.uint8, device=dev))
    except oom:
        fill_raised = True
    reached = torch.cuda.memory_reserved(dev)
    allocated = torch.cuda.memory_allocated(dev)
    del held
    torch.cuda.empty_cache()
    return {
        "pid": os.getpid(),
        "fraction": fraction,
        "total_mb": total / MiB,
        "fraction_mb": limit / MiB,
        "one_shot_raised": one_shot_raised,
        "fill_raised": fill_raised,
        "reached_reserved_mb": reached / MiB,
        "reached_allocated_mb": allocated / MiB,
        "chunk_mb": chunk_mb,
    }


def _child_arena(batches: int, sizes: tuple[int, ...]) -> dict[str, Any]:
    import torch

    rt = _runtime(0.2)
    dev = rt.device
    model = _mlp(rt)
    inputs = {n: torch.randn(n, 512) for n in sizes}

    def one(n: int) -> None:
        with rt.batch_context():
            (x,) = _to_device(rt, [inputs[n]])
            y = model(x)
            y.float().cpu()

    for n in sizes:  # warmup over every batch size
        one(n)
        one(n)
    torch.cuda.synchronize(dev)
    reserved0 = torch.cuda.memory_reserved(dev)
    allocated0 = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    for i in range(batches):
        one(sizes[i % len(sizes)])
    torch.cuda.synchronize(dev)
    elapsed = time.perf_counter() - t0
    stats = rt.stats()
    return {
        "batches": batches,
        "batch_sizes": list(sizes),
        "staged_through_arena": hasattr(rt, "stage"),
        "reserved_mb_before": reserved0 / MiB,
        "reserved_mb_after": torch.cuda.memory_reserved(dev) / MiB,
        "allocated_mb_before": allocated0 / MiB,
        "allocated_mb_after": torch.cuda.memory_allocated(dev) / MiB,
        "peak_reserved_mb": torch.cuda.max_memory_reserved(dev) / MiB,
        "arena_overflows": stats.get("arena_overflows"),
        "ms_per_batch": elapsed / batches * 1000.0,
    }


def _child_latency(warm: bool, steady: int) -> dict[str, Any]:
    import torch

    rt = _runtime(0.2)
    model = _cnn(rt)
    sizes = (1, 8, 32)
    inputs = {n: torch.randn(n, 3, 64, 64) for n in sizes}

    def one(n: int) -> float:
        t0 = time.perf_counter()
        with rt.batch_context():
            (x,) = _to_device(rt, [inputs[n]])
            model(x).float().cpu()
        return time.perf_counter() - t0

    warmup_s = None
    if warm:

        def warm_all() -> None:
            for n in sizes:
                one(n)
                one(n)

        warmup_s = rt.warmup(warm_all)
    first = one(8)
    times = [one(8) for _ in range(steady)]
    return {
        "pid": os.getpid(),
        "warm": warm,
        "warmup_s": warmup_s,
        "first_ms": first * 1000.0,
        "steady_median_ms": statistics.median(times) * 1000.0,
    }


def _overlap_ops(
    rt: Any, copy_mb: int, n: int
) -> tuple[Callable[[], None], Callable[[int], None], Any]:
    """A pinned H2D copy of ``copy_mb`` MiB on a side stream, and ``k`` bf16 ``n x n``
    matmuls on the runtime's stream; returns ``(copy, compute, copy_stream)``."""
    import torch

    dev = rt.device
    host = torch.empty(copy_mb * MiB, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(copy_mb * MiB, dtype=torch.uint8, device=dev)
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    copy_stream = torch.cuda.Stream(dev)
    compute_stream = rt.stream

    def copy() -> None:
        with torch.cuda.stream(copy_stream):
            dst.copy_(host, non_blocking=True)

    def compute(k: int) -> None:
        with torch.cuda.stream(compute_stream):
            for _ in range(k):
                torch.matmul(a, b, out=c)

    return copy, compute, copy_stream


def _timed(dev: Any, fn: Callable[[], None]) -> float:
    """Seconds ``fn`` takes, from an idle device to an idle device."""
    import torch

    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def _median_time(dev: Any, fn: Callable[[], None], reps: int) -> float:
    return statistics.median(_timed(dev, fn) for _ in range(reps))


def _child_overlap(copy_mb: int, n: int, reps: int) -> dict[str, Any]:
    rt = _runtime(0.3)
    dev = rt.device
    copy, compute, copy_stream = _overlap_ops(rt, copy_mb, n)
    compute_stream = rt.stream

    _timed(dev, copy)
    _timed(dev, lambda: compute(3))
    t_copy = _median_time(dev, copy, reps)
    per_mm = _median_time(dev, lambda: compute(10), reps) / 10
    k = max(1, round(t_copy / per_mm))  # matmuls that take about as long as the copy
    t_compute = _median_time(dev, lambda: compute(k), reps)

    def sequential() -> None:
        copy()
        compute_stream.wait_stream(copy_stream)  # compute starts after the copy ends
        compute(k)

    def concurrent() -> None:
        copy()
        compute(k)

    t_seq = _median_time(dev, sequential, reps)
    t_conc = _median_time(dev, concurrent, reps)
    hidden = (t_seq - t_conc) / min(t_copy, t_compute)
    return {
        "copy_mb": copy_mb,
        "h2d_gb_s": copy_mb * MiB / t_copy / 1e9,
        "matmul_n": n,
        "matmuls": k,
        "copy_ms": t_copy * 1000.0,
        "compute_ms": t_compute * 1000.0,
        "sequential_ms": t_seq * 1000.0,
        "concurrent_ms": t_conc * 1000.0,
        "overlap_ratio": hidden,
    }
