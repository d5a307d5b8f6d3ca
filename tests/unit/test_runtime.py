"""DeviceRuntime on the CPU path: arena staging, partition validation, CUDA guard."""

from __future__ import annotations

import pytest
import torch

from shared.errors import DeviceError
from shared.settings import DeviceConfig, load_settings
from workers.models.runtime import DeviceRuntime, refuse_early_cuda, validate_partitions


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


class _Stack(torch.nn.Module):
    """Four linear layers in a ModuleList, as a transformer encoder holds its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_main_lane_pauses_at_a_yield_point_while_a_realtime_batch_runs() -> None:
    import threading

    rt = DeviceRuntime(DeviceConfig(arena_mb=1), lanes=2)
    rt.start()
    model = _Stack()
    assert rt.install_yield_points([model]) == 4  # each Linear inside the ModuleList
    finished = threading.Event()

    def main_lane() -> None:
        rt.bind_lane(0)
        with torch.inference_mode():
            model(torch.ones(2, 8))
        finished.set()

    with rt.realtime_section():
        t = threading.Thread(target=main_lane)
        t.start()
        # While the REALTIME section is open the main lane stays parked at its first layer.
        assert not finished.wait(0.3)
        assert t.is_alive()
    assert finished.wait(5)  # the section closed: it resumes and completes
    t.join(5)
    stats = rt.stats()
    assert stats["realtime_pauses"] == 1 and stats["realtime_paused_s"] >= 0.25
    assert stats["yield_points"] == 4


def test_realtime_lane_and_a_lone_lane_never_pause() -> None:
    rt = DeviceRuntime(DeviceConfig(arena_mb=1), lanes=2)
    rt.start()
    model = _Stack()
    rt.install_yield_points([model])
    rt.bind_lane(1)  # the REALTIME lane itself runs through its own section
    with rt.realtime_section(), torch.inference_mode():
        model(torch.ones(1, 8))
    single = DeviceRuntime(DeviceConfig(arena_mb=1), lanes=1)
    single.start()
    other = _Stack()
    single.install_yield_points([other])
    with single.realtime_section(), torch.inference_mode():
        other(torch.ones(1, 8))  # one lane: nothing to yield to
    assert rt.stats()["realtime_pauses"] == 0 and single.stats()["realtime_pauses"] == 0


def test_main_lane_thread_runs_at_the_configured_nice_and_others_do_not() -> None:
    import os
    import threading

    rt = DeviceRuntime(DeviceConfig(arena_mb=1, main_lane_nice=7), lanes=2)
    rt.start()
    seen: dict[int, int] = {}

    def bind(lane: int) -> None:
        before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        rt.bind_lane(lane)
        seen[lane] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) - before

    for lane in (0, 1):
        t = threading.Thread(target=bind, args=(lane,))
        t.start()
        t.join()
    assert seen == {0: 7, 1: 0}  # only the main lane's own thread was reniced
    assert rt.stats()["main_lane_nice"] == 7
