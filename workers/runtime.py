"""The per-process device runtime: device, CUDA stream, memory partition, threads.

One :class:`DeviceRuntime` per worker process, created after the process starts (never
before a fork: CUDA must not be initialised in a parent). On a machine without CUDA the same
API runs on the CPU: no stream, the staging arena in host memory, and ``torch`` thread
counts from config.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from shared.errors import DeviceError
from shared.settings import DeviceConfig

log = logging.getLogger(__name__)


class DeviceRuntime:
    """Owns one device slot for one worker process.

    Args:
        cfg: ``device`` (``"cpu"``, ``"cuda"`` or ``"cuda:N"``), ``torch_threads``,
            ``interop_threads``, ``memory_fraction`` (of the GPU's total memory, CUDA only),
            ``arena_mb`` (staging arena size in MiB).

    Raises:
        DeviceError: from :meth:`start` when CUDA is asked for but not available.
    """

    def __init__(self, cfg: DeviceConfig) -> None:
        self.cfg = cfg
        self.device = torch.device("cpu")
        self.stream: Any = None
        self.started = False
        self.warmup_s: float | None = None
        self._arena: torch.Tensor | None = None

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Pin threads, open the device, set the memory fraction, allocate the arena."""
        torch.set_num_threads(self.cfg.torch_threads)
        with contextlib.suppress(RuntimeError):  # only settable once per process
            torch.set_num_interop_threads(self.cfg.interop_threads)
        want = self.cfg.device
        if want.startswith("cuda"):
            if not torch.cuda.is_available():
                raise DeviceError(f"device {want!r} configured but CUDA is not available")
            self.device = torch.device(want if ":" in want else "cuda:0")
            torch.cuda.set_device(self.device)
            torch.cuda.set_per_process_memory_fraction(self.cfg.memory_fraction, self.device)
            self.stream = torch.cuda.Stream(device=self.device)
        arena_bytes = self.cfg.arena_mb * 1024 * 1024
        if arena_bytes:
            pin = self.device.type == "cuda"
            self._arena = torch.empty(arena_bytes, dtype=torch.uint8, pin_memory=pin)
        self.started = True
        log.info("device runtime started: %s", self.stats())

    @contextlib.contextmanager
    def batch_context(self) -> Iterator[None]:
        """Run a batch: ``torch.inference_mode()`` and, on CUDA, the worker's own stream."""
        with torch.inference_mode():
            if self.stream is None:
                yield
                return
            with torch.cuda.stream(self.stream):
                yield
            self.stream.synchronize()

    def warmup(self, fn: Any) -> float:
        """Time a warmup callable once; records and returns its duration in seconds."""
        t0 = time.perf_counter()
        fn()
        self.warmup_s = time.perf_counter() - t0
        return self.warmup_s

    # -- observability ------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Device facts for the startup log and the worker's stats (JSON-able)."""
        out: dict[str, Any] = {
            "device": str(self.device),
            "torch_threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
            "stream": None,
            "memory_fraction": None,
            "arena_bytes": 0 if self._arena is None else self._arena.numel(),
            "warmup_s": self.warmup_s,
        }
        if self.stream is not None:
            out["stream"] = int(self.stream.cuda_stream)
            out["memory_fraction"] = self.cfg.memory_fraction
            out["cuda_reserved_mb"] = torch.cuda.memory_reserved(self.device) / 2**20
        return out
