"""The device runtime on a real GPU, and ``make gpu-check``'s own plumbing.

Tests marked ``gpu`` need CUDA and are skipped without it; they check what only a GPU can
show: the worker's stream is not the default stream, the memory fraction is enforced, the
staging arena does not grow, warmup pays the first batch's costs, copies overlap compute.
The heavier ones run in spawned child processes (the same code as ``python -m
producer.tools.gpucheck``), so the memory fractions they set do not stay in this process.

The unmarked tests run everywhere: the script's skip path without CUDA, its child-process
helper, and how each check judges its figures (fed canned figures).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from producer.tools.gpucheck import checks
from producer.tools.gpucheck.children import CheckFailed, run_in_children
from producer.tools.gpucheck.cli import SKIP_LINE

REPO = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
gpu = [pytest.mark.gpu, needs_cuda]


# -- everywhere -----------------------------------------------------------------------------
@pytest.mark.skipif(HAS_CUDA, reason="the skip path is for machines without CUDA")
def test_gpu_check_skips_cleanly_without_cuda() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "producer.tools.gpucheck"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == SKIP_LINE


def test_run_in_children_runs_each_in_its_own_process_in_order() -> None:
    pids = run_in_children(os.getpid, [(), ()], timeout_s=60)
    assert len(pids) == 2 and len(set(pids)) == 2 and os.getpid() not in pids
    assert run_in_children(divmod, [(7, 2), (9, 4)], timeout_s=60) == [(3, 1), (2, 1)]


def test_run_in_children_reports_a_child_exception() -> None:
    with pytest.raises(CheckFailed, match="ValueError"):
        run_in_children(int, [("not a number",)], timeout_s=60)


def test_run_in_children_times_out_and_stops_the_child() -> None:
    t0 = time.monotonic()
    with pytest.raises(CheckFailed, match="no answer"):
        run_in_children(time.sleep, [(60,)], timeout_s=3)
    assert time.monotonic() - t0 < 30


def _fake_children(figures: dict[str, Any]) -> Any:
    def fake(fn: Any, args_list: Any, timeout_s: float = 0.0) -> list[Any]:
        got = figures[fn.__name__]
        return [got(*args) for args in args_list] if callable(got) else got

    return fake


def _good_figures() -> dict[str, Any]:
    """What each child reports on a healthy GPU (shapes as ``producer.tools.gpucheck.probes``
    builds)."""

    def stream(_barrier: Any) -> dict[str, Any]:
        pid = stream.n = getattr(stream, "n", 100) + 1  # type: ignore[attr-defined]
        return {
            "pid": pid,
            "stream": 0x5A5A0000 + pid,
            "default_stream": 0,
            "current_in_batch_is_own": True,
            "stats_stream": 0x5A5A0000 + pid,
            "result_ok": True,
        }

    def latency(warm: bool, steady: int) -> dict[str, Any]:
        return {
            "pid": 1,
            "warm": warm,
            "warmup_s": 0.4 if warm else None,
            "first_ms": 1.2 if warm else 250.0,
            "steady_median_ms": 1.0,
        }

    return {
        "_child_stream": stream,
        "_child_fraction": [
            {
                "pid": 1,
                "fraction": 0.05,
                "total_mb": 143771.0,
                "fraction_mb": 7188.6,
                "one_shot_raised": True,
                "fill_raised": True,
                "reached_reserved_mb": 7168.0,
                "reached_allocated_mb": 7104.0,
                "chunk_mb": 64,
            }
        ],
        "_child_arena": [
            {
                "batches": 1000,
                "batch_sizes": [1, 8, 16, 32],
                "staged_through_arena": True,
                "reserved_mb_before": 86.0,
                "reserved_mb_after": 86.0,
                "allocated_mb_before": 72.1,
                "allocated_mb_after": 72.1,
                "peak_reserved_mb": 86.0,
                "arena_overflows": 0,
                "ms_per_batch": 0.3,
            }
        ],
        "_child_latency": latency,
        "_child_overlap": [
            {
                "copy_mb": 1024,
                "h2d_gb_s": 52.0,
                "matmul_n": 8192,
                "matmuls": 12,
                "copy_ms": 20.6,
                "compute_ms": 21.0,
                "sequential_ms": 41.8,
                "concurrent_ms": 22.0,
                "overlap_ratio": 0.96,
            }
        ],
    }


def test_checks_judge_good_figures_as_passing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checks, "run_in_children", _fake_children(_good_figures()))
    lines: list[str] = []
    results = checks.run_checks(out=lines.append)
    assert [r.ok for r in results] == [True] * 5, lines
    assert all(line.startswith("gpu-check: [PASS]") for line in lines)
    assert "7168 MiB of 7189 MiB" in lines[1]
    assert "overlap ratio 0.96" in lines[4]


def test_checks_judge_bad_figures_as_failing(monkeypatch: pytest.MonkeyPatch) -> None:
    figures = _good_figures()
    # every process on the default stream, the same one
    figures["_child_stream"] = lambda _barrier: {
        "pid": 7,
        "stream": 0,
        "default_stream": 0,
        "current_in_batch_is_own": False,
        "stats_stream": None,
        "result_ok": True,
    }
    # filled 3x its fraction without an OOM
    figures["_child_fraction"][0].update(
        one_shot_raised=False,
        fill_raised=False,
        reached_reserved_mb=21566.0,
        reached_allocated_mb=21566.0,
    )
    # the arena was bypassed and reserved memory grew
    figures["_child_arena"][0].update(
        staged_through_arena=False,
        reserved_mb_after=120.0,
        allocated_mb_after=80.0,
        peak_reserved_mb=120.0,
        arena_overflows=3,
    )
    # warmup bought nothing: the first batch is as slow as a cold one
    figures["_child_latency"] = lambda warm, steady: {
        "pid": 1,
        "warm": warm,
        "warmup_s": 0.4 if warm else None,
        "first_ms": 300.0,
        "steady_median_ms": 1.0,
    }
    # copy and compute ran one after the other
    figures["_child_overlap"][0].update(concurrent_ms=41.0, overlap_ratio=0.04)
    monkeypatch.setattr(checks, "run_in_children", _fake_children(figures))
    lines: list[str] = []
    results = checks.run_checks(out=lines.append)
    assert [r.ok for r in results] == [False] * 5, lines
    assert "default stream" in results[0].detail
    assert "without raising" in results[1].detail
    assert "reserved grew" in results[2].detail
    assert "not faster" in results[3].detail
    assert "did not overlap" in results[4].detail


def test_a_check_that_raises_is_reported_as_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: Any, **__: Any) -> list[Any]:
        raise CheckFailed("child died")

    monkeypatch.setattr(checks, "run_in_children", boom)
    lines: list[str] = []
    (res,) = checks.run_checks([checks.check_overlap], out=lines.append)
    assert not res.ok and "child died" in res.detail
    assert lines[0].startswith("gpu-check: [FAIL]")


# -- on a GPU -------------------------------------------------------------------------------
@pytest.fixture
def cuda_runtime() -> Iterator[Any]:
    """A started CUDA runtime in this process; the memory fraction is lifted again after."""
    from shared.settings import DeviceConfig
    from workers.models.runtime import DeviceRuntime

    rt = DeviceRuntime(DeviceConfig(device="cuda:0", memory_fraction=0.2, arena_mb=16))
    rt.start()
    yield rt
    torch.cuda.synchronize(rt.device)
    torch.cuda.set_per_process_memory_fraction(1.0, rt.device)
    torch.cuda.empty_cache()


@pytest.mark.gpu
@needs_cuda
def test_runtime_uses_its_own_stream_not_the_default(cuda_runtime: Any) -> None:
    rt = cuda_runtime
    assert rt.device.type == "cuda"
    assert rt.stream is not None
    default = torch.cuda.default_stream(rt.device)
    assert rt.stream != default
    assert int(rt.stream.cuda_stream) not in (0, int(default.cuda_stream))
    with rt.batch_context():
        assert torch.cuda.current_stream(rt.device) == rt.stream
        assert torch.is_inference_mode_enabled()
        y = torch.arange(10, device=rt.device, dtype=torch.float32) * 3
    assert torch.cuda.current_stream(rt.device) == default
    assert y.sum().item() == 135.0  # batch_context synchronised the stream on exit
    s = rt.stats()
    assert s["stream"] == int(rt.stream.cuda_stream)
    assert s["memory_fraction"] == 0.2
    assert s["cuda_reserved_mb"] is not None and s["cuda_reserved_mb"] > 0
    assert s["arena_pinned"] is True


@pytest.mark.gpu
@needs_cuda
def test_stage_puts_inputs_on_the_device_without_growing(cuda_runtime: Any) -> None:
    rt = cuda_runtime
    if not hasattr(rt, "stage"):
        pytest.skip("this runtime has no stage()")
    ids = torch.randint(0, 30000, (32, 64), dtype=torch.int64)
    pix = torch.randn(4, 3, 32, 32)
    with rt.batch_context():
        out = rt.stage([ids, pix])
        got = [t.cpu() for t in out]
    assert [t.device.type for t in out] == ["cuda", "cuda"]
    assert torch.equal(got[0], ids) and torch.equal(got[1], pix)
    reserved = torch.cuda.memory_reserved(rt.device)
    for _ in range(200):
        with rt.batch_context():
            rt.stage([ids, pix])
    assert torch.cuda.memory_reserved(rt.device) == reserved
    assert rt.stats()["arena_overflows"] == 0


@pytest.mark.gpu
@needs_cuda
def test_each_process_gets_its_own_non_default_stream() -> None:
    res = checks.check_stream_per_process()
    assert res.ok, res.detail


@pytest.mark.gpu
@needs_cuda
def test_memory_fraction_is_enforced() -> None:
    res = checks.check_memory_fraction(fraction=0.05)
    assert res.ok, res.detail
    assert res.figures["one_shot_raised"] and res.figures["fill_raised"]
    assert res.figures["reached_reserved_mb"] <= res.figures["fraction_mb"] + 1


@pytest.mark.gpu
@needs_cuda
def test_no_device_memory_growth_over_1000_batches() -> None:
    res = checks.check_arena_growth(batches=1000)
    assert res.ok, res.detail


@pytest.mark.gpu
@needs_cuda
def test_warm_first_batch_is_faster_than_cold() -> None:
    res = checks.check_warm_vs_cold()
    assert res.ok, res.detail


@pytest.mark.gpu
@needs_cuda
def test_h2d_copy_overlaps_compute_on_another_stream() -> None:
    res = checks.check_overlap()
    assert res.ok, res.detail
