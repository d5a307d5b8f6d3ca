"""DeviceRuntime on the CPU path: arena staging, partition validation, CUDA guard."""

from __future__ import annotations

import pytest
import torch

from shared.errors import DeviceError
from shared.settings import DeviceConfig, load_settings
from workers.runtime import DeviceRuntime, refuse_early_cuda, validate_partitions


def started(arena_mb: int = 1) -> DeviceRuntime:
    rt = DeviceRuntime(DeviceConfig(arena_mb=arena_mb))
    rt.start()
    return rt


def test_stage_copies_into_the_arena_and_reuses_it() -> None:
    rt = started()
    ids = torch.arange(12, dtype=torch.long).view(3, 4)
    pix = torch.rand(2, 3, 8, 8)
    a, b = rt.stage([ids, pix])
    assert torch.equal(a, ids) and torch.equal(b, pix)
    assert a.dtype == torch.long and b.shape == (2, 3, 8, 8)
    base = rt._host.data_ptr()  # type: ignore[union-attr]
    end = base + rt._host.numel()  # type: ignore[union-attr]
    assert base <= a.data_ptr() < end and base <= b.data_ptr() < end
    (again,) = rt.stage([ids])
    assert again.data_ptr() == a.data_ptr()  # the same slot, nothing new allocated
    assert rt.stats()["arena_overflows"] == 0


def test_batch_larger_than_the_arena_falls_back_and_is_counted() -> None:
    rt = started(arena_mb=1)
    big = torch.zeros(2 * 1024 * 1024, dtype=torch.uint8)
    (out,) = rt.stage([big])
    assert torch.equal(out, big)
    assert rt.stats()["arena_overflows"] == 1


def test_cpu_runtime_reports_no_stream_and_its_threads() -> None:
    s = started().stats()
    assert s["device"] == "cpu" and s["stream"] is None and s["memory_fraction"] is None
    assert s["arena_bytes"] == 1024 * 1024 and s["torch_threads"] == 1


def test_cuda_requested_without_cuda_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DeviceError, match="CUDA is not available"):
        DeviceRuntime(DeviceConfig(device="cuda:0")).start()


def test_partitions_on_one_gpu_must_sum_to_at_most_0_9() -> None:
    def cfg(a: float, b: float, dev_b: str = "cuda:0") -> object:
        base = load_settings()
        mods = {k: v.model_dump() for k, v in base.modalities.items()}
        mods["text"]["device"].update(device="cuda:0", memory_fraction=a)
        mods["image"]["device"].update(device=dev_b, memory_fraction=b)
        return load_settings(modalities=mods)

    validate_partitions(cfg(0.4, 0.5))  # 0.9: allowed
    validate_partitions(cfg(0.6, 0.6, dev_b="cuda:1"))  # different GPUs
    with pytest.raises(DeviceError, match=r"sum to 1\.00"):
        validate_partitions(cfg(0.5, 0.5))


def test_no_early_cuda_in_a_cpu_process() -> None:
    refuse_early_cuda()  # would raise if anything imported so far had initialised CUDA
    assert not torch.cuda.is_initialized()
