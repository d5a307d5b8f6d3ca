"""``make gpu-check``: one short script that checks the device runtime on a CUDA machine.

``python -m workers.gpu_check [--out FILE.json]``. Without CUDA it prints
``gpu-check: skipped (no CUDA device)`` and exits 0. With CUDA it runs five checks, each in
fresh processes of the ``spawn`` context (CUDA is never initialised in this parent process),
prints each figure, and exits 1 if any check fails:

1. stream per process: two processes at once, each with a started
   ``DeviceRuntime(device="cuda:0", memory_fraction=0.2)``, report a stream handle that is
   not the default stream, and inside ``batch_context()`` the current stream is theirs;
2. memory fraction enforced: with ``memory_fraction=0.05``, one allocation past the fraction
   raises ``torch.OutOfMemoryError``, and filling memory in 64 MiB chunks raises before the
   reserved memory passes the fraction (reports the MiB reached vs the fraction's MiB);
3. no arena growth over 1,000 batches: a small MLP, batch sizes cycling 1/8/16/32 through
   ``stage()`` (when the runtime has it) and ``batch_context()``; reserved and allocated
   device memory after the 1,000 batches are no larger than after the warmup;
4. warm vs cold first-batch latency: the first batch of a fresh process without warmup
   (cold) vs after ``runtime.warmup`` over every batch size (warm), and the steady-state
   median; the warm first batch must be faster than the cold one;
5. compute/copy overlap: a 1 GiB pinned host-to-device copy on a side stream while a bf16
   matmul loop runs on the runtime's stream, vs the two one after the other; the overlap
   ratio is the time saved over the shorter of the two (1.0 = fully hidden).

Total run time is well under the 5 minutes the issue allows (about a minute on an H200:
most of it is starting the child processes).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SKIP_LINE = "gpu-check: skipped (no CUDA device)"
CHECK_TIMEOUT_S = 90.0
MiB = 2**20


class CheckFailed(AssertionError):
    """A check's condition does not hold (or a child process failed)."""


@dataclass
class CheckResult:
    name: str
    ok: bool
    figures: dict[str, Any] = field(default_factory=dict)
    detail: str = ""
    seconds: float = 0.0


# -- child-process plumbing -----------------------------------------------------------------
def _child_entry(q: Any, index: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        q.put((index, True, fn(*args)))
    except BaseException:
        q.put((index, False, traceback.format_exc()))


def run_in_children(
    fn: Callable[..., Any],
    args_list: Sequence[tuple[Any, ...]],
    timeout_s: float = CHECK_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(*args)`` for each ``args`` in its own spawned process, all at once.

    ``fn`` must be a module-level function and its arguments and result picklable.

    Returns:
        The results, in the order of ``args_list``.

    Raises:
        CheckFailed: a child raised (its traceback is in the message), died, or did not
            answer within ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_child_entry, args=(q, i, fn, args), daemon=True)
        for i, args in enumerate(args_list)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < len(procs):
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckFailed(f"{fn.__name__}: no answer within {timeout_s:.0f} s")
            try:
                i, ok, payload = q.get(timeout=min(left, 0.5))
            except queue.Empty:
                for i, p in enumerate(procs):
                    if i not in results and p.exitcode not in (None, 0):
                        raise CheckFailed(
                            f"{fn.__name__}: child {i} died with exit code {p.exitcode}"
                        ) from None
                continue
            if not ok:
                raise CheckFailed(f"{fn.__name__}: child {i} raised:\n{payload}")
            results[i] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        q.close()
    return [results[i] for i in range(len(procs))]


def _runtime(fraction: float, arena_mb: int = 64) -> Any:
    from shared.settings import DeviceConfig
    from workers.runtime import DeviceRuntime

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


# -- (1) stream per process -----------------------------------------------------------------
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


def check_stream_per_process() -> CheckResult:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    a, b = run_in_children(_child_stream, [(barrier,), (barrier,)])
    figs = {"processes": [a, b]}
    problems = []
    for r in (a, b):
        if r["stream"] in (0, r["default_stream"]):
            problems.append(f"pid {r['pid']} runs on the default stream ({r['stream']:#x})")
        if not r["current_in_batch_is_own"]:
            problems.append(f"pid {r['pid']}: batch_context() does not make its stream current")
        if r["stats_stream"] != r["stream"]:
            problems.append(f"pid {r['pid']}: stats() reports stream {r['stats_stream']}")
        if not r["result_ok"]:
            problems.append(f"pid {r['pid']}: wrong result on its stream")
    if a["pid"] == b["pid"]:
        problems.append("both runtimes ran in one process")
    detail = "; ".join(
        f"pid {r['pid']} stream {r['stream']:#x} (default {r['default_stream']:#x})" for r in (a, b)
    )
    return CheckResult("stream per process", not problems, figs, "; ".join(problems) or detail)


# -- (2) memory fraction enforced -----------------------------------------------------------
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


def check_memory_fraction(fraction: float = 0.05, chunk_mb: int = 64) -> CheckResult:
    (r,) = run_in_children(_child_fraction, [(fraction, chunk_mb)])
    problems = []
    if not r["one_shot_raised"]:
        problems.append("one allocation of 1.05 x the fraction did not raise")
    if not r["fill_raised"]:
        problems.append(f"filling reached {r['reached_reserved_mb']:.0f} MiB without raising")
    if r["reached_reserved_mb"] > r["fraction_mb"] + 1:
        problems.append("reserved memory passed the fraction")
    if r["reached_reserved_mb"] < 0.8 * r["fraction_mb"] - r["chunk_mb"]:
        problems.append("raised well before the fraction was used (under 80%)")
    detail = (
        f"reached {r['reached_reserved_mb']:.0f} MiB of {r['fraction_mb']:.0f} MiB "
        f"(fraction {r['fraction']} of {r['total_mb']:.0f} MiB) before OutOfMemoryError"
    )
    return CheckResult("memory fraction enforced", not problems, r, "; ".join(problems) or detail)


# -- (3) no arena growth over 1,000 batches -------------------------------------------------
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


def check_arena_growth(batches: int = 1000, sizes: tuple[int, ...] = (1, 8, 16, 32)) -> CheckResult:
    (r,) = run_in_children(_child_arena, [(batches, sizes)])
    problems = []
    if r["reserved_mb_after"] > r["reserved_mb_before"]:
        problems.append(
            f"reserved grew {r['reserved_mb_before']:.1f} -> {r['reserved_mb_after']:.1f} MiB"
        )
    if r["allocated_mb_after"] > r["allocated_mb_before"]:
        problems.append(
            f"allocated grew {r['allocated_mb_before']:.2f} -> {r['allocated_mb_after']:.2f} MiB"
        )
    if r["arena_overflows"]:
        problems.append(f"{r['arena_overflows']} batches overflowed the arena")
    detail = (
        f"{r['batches']} batches: reserved {r['reserved_mb_before']:.1f} -> "
        f"{r['reserved_mb_after']:.1f} MiB, allocated {r['allocated_mb_before']:.2f} -> "
        f"{r['allocated_mb_after']:.2f} MiB, {r['ms_per_batch']:.2f} ms/batch"
        f"{'' if r['staged_through_arena'] else ' (runtime has no stage(): plain copies)'}"
    )
    return CheckResult("no arena growth", not problems, r, "; ".join(problems) or detail)


# -- (4) warm vs cold first-batch latency ---------------------------------------------------
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


def check_warm_vs_cold(steady: int = 50) -> CheckResult:
    # One after the other, each in a fresh process, so neither disturbs the other's timing.
    (cold,) = run_in_children(_child_latency, [(False, steady)])
    (warm,) = run_in_children(_child_latency, [(True, steady)])
    steady_ms = statistics.median([cold["steady_median_ms"], warm["steady_median_ms"]])
    figs = {
        "cold_first_ms": cold["first_ms"],
        "warm_first_ms": warm["first_ms"],
        "steady_median_ms": steady_ms,
        "warmup_s": warm["warmup_s"],
        "cold_over_steady": cold["first_ms"] / steady_ms if steady_ms else None,
        "warm_over_steady": warm["first_ms"] / steady_ms if steady_ms else None,
    }
    problems = []
    if not warm["first_ms"] < cold["first_ms"]:
        problems.append("the warm first batch was not faster than the cold one")
    detail = (
        f"first batch cold {cold['first_ms']:.2f} ms, warm {warm['first_ms']:.2f} ms, "
        f"steady median {steady_ms:.3f} ms (warmup took {warm['warmup_s']:.2f} s)"
    )
    return CheckResult(
        "warm vs cold first batch", not problems, figs, "; ".join(problems) or detail
    )


# -- (5) compute/copy overlap ---------------------------------------------------------------
def _child_overlap(copy_mb: int, n: int, reps: int) -> dict[str, Any]:
    import torch

    rt = _runtime(0.3)
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

    def timed(fn: Callable[[], None]) -> float:
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    def median_of(fn: Callable[[], None]) -> float:
        return statistics.median(timed(fn) for _ in range(reps))

    timed(copy)
    timed(lambda: compute(3))
    t_copy = median_of(copy)
    per_mm = median_of(lambda: compute(10)) / 10
    k = max(1, round(t_copy / per_mm))  # matmuls that take about as long as the copy
    t_compute = median_of(lambda: compute(k))

    def sequential() -> None:
        copy()
        compute_stream.wait_stream(copy_stream)  # compute starts after the copy ends
        compute(k)

    def concurrent() -> None:
        copy()
        compute(k)

    t_seq = median_of(sequential)
    t_conc = median_of(concurrent)
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


def check_overlap(copy_mb: int = 1024, n: int = 8192, reps: int = 5) -> CheckResult:
    (r,) = run_in_children(_child_overlap, [(copy_mb, n, reps)])
    ok = r["overlap_ratio"] >= 0.3
    detail = (
        f"{r['copy_mb']} MiB H2D {r['copy_ms']:.1f} ms ({r['h2d_gb_s']:.1f} GB/s), "
        f"{r['matmuls']} x matmul {n} bf16 {r['compute_ms']:.1f} ms; sequential "
        f"{r['sequential_ms']:.1f} ms, concurrent {r['concurrent_ms']:.1f} ms; "
        f"overlap ratio {r['overlap_ratio']:.2f}"
    )
    if not ok:
        detail = "copy and compute did not overlap (ratio < 0.3): " + detail
    return CheckResult("compute/copy overlap", ok, r, detail)


CHECKS: tuple[Callable[[], CheckResult], ...] = (
    check_stream_per_process,
    check_memory_fraction,
    check_arena_growth,
    check_warm_vs_cold,
    check_overlap,
)


def run_checks(
    checks: Sequence[Callable[[], CheckResult]] = CHECKS,
    out: Callable[[str], None] = print,
) -> list[CheckResult]:
    results = []
    for check in checks:
        t0 = time.monotonic()
        try:
            res = check()
        except Exception as exc:
            name = check.__name__.removeprefix("check_").replace("_", " ")
            res = CheckResult(name, False, {}, f"{type(exc).__name__}: {exc}")
        res.seconds = time.monotonic() - t0
        out(f"gpu-check: [{'PASS' if res.ok else 'FAIL'}] {res.name}: {res.detail}")
        results.append(res)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.gpu_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args(argv)

    import torch

    # is_available() does not create a CUDA context here: the checks run in spawned children.
    if not torch.cuda.is_available():
        print(SKIP_LINE, flush=True)
        return 0
    t0 = time.monotonic()
    print(
        f"gpu-check: torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"{torch.cuda.device_count()} device(s)",
        flush=True,
    )
    results = run_checks(out=lambda s: print(s, flush=True))
    total = time.monotonic() - t0
    passed = sum(r.ok for r in results)
    print(f"gpu-check: {passed}/{len(results)} checks passed in {total:.1f} s", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"total_s": total, "checks": [asdict(r) for r in results]}, indent=2, default=str
            )
            + "\n"
        )
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    # Run through the importable module, so that the functions the children run pickle as
    # ``workers.gpu_check.*`` and not as ``__main__.*``.
    from workers.gpu_check import main as _main

    sys.exit(_main())
