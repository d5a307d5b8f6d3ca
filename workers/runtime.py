"""The per-process device runtime: device, CUDA stream, memory partition, staging arena.

One :class:`DeviceRuntime` per worker process, created after the process starts (never
before a fork: CUDA must not be initialised in a parent). On a machine without CUDA the same
API runs on the CPU: no stream, the staging arena in host memory, and ``torch`` thread
counts from config.

Staging arena
-------------
``arena_mb`` bytes are allocated once at start: a pinned host buffer and, on CUDA, a device
buffer of the same size, both as tensors this runtime owns (so PyTorch's caching allocator
and its safety checks stay in charge; no raw pointers). :meth:`DeviceRuntime.stage` copies a
batch's input tensors into the host buffer and, on CUDA, from there to the device buffer on
the worker's stream, and returns views: steady state allocates nothing new for inputs. A
batch too large for the arena falls back to ordinary allocation and is counted
(``arena_overflows`` in the stats).

Lanes
-----
A worker may run two inference threads (the main lane and the REALTIME lane). Each lane
gets its own CUDA stream and its own half of the arena; a thread says which lane it is with
:meth:`DeviceRuntime.bind_lane`, and ``stream``/``stage``/``batch_context`` then use that
lane's resources.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from shared.errors import DeviceError
from shared.settings import DeviceConfig

if TYPE_CHECKING:
    from shared.settings import Settings

log = logging.getLogger(__name__)

MAX_GPU_FRACTION = 0.9  # headroom for the CUDA context and other processes
_ALIGN = 256  # bytes; CUDA's allocation granularity for coalesced access


def validate_partitions(settings: Settings) -> None:
    """Check that the memory fractions configured on each GPU sum to at most 0.9.

    Raises:
        DeviceError: a GPU is over-committed (names the modalities and the sum).
    """
    per_gpu: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for name, m in settings.modalities.items():
        dev = m.device.device
        if dev.startswith("cuda"):
            per_gpu[dev if ":" in dev else "cuda:0"].append((name, m.device.memory_fraction))
    for gpu, parts in per_gpu.items():
        total = sum(f for _, f in parts)
        if total > MAX_GPU_FRACTION + 1e-9:
            detail = ", ".join(f"{n}={f}" for n, f in parts)
            raise DeviceError(
                f"memory fractions on {gpu} sum to {total:.2f} > {MAX_GPU_FRACTION} ({detail})"
            )


def refuse_early_cuda() -> None:
    """Refuse to start when CUDA was initialised before the worker's own start.

    A module that touches CUDA at import time would have done so in whatever process
    imported it first; under a forking pool that parent's CUDA context is unusable in the
    children. The worker calls this before creating its runtime.

    Raises:
        DeviceError: CUDA is already initialised in this process.
    """
    if torch.cuda.is_initialized():
        raise DeviceError(
            "CUDA was initialised before the worker started (a module touching CUDA at import "
            "time?); CUDA must be initialised only by the worker's DeviceRuntime"
        )


class DeviceRuntime:
    """Owns one device slot for one worker process.

    Args:
        cfg: ``device`` (``"cpu"``, ``"cuda"`` or ``"cuda:N"``), ``torch_threads``,
            ``interop_threads``, ``memory_fraction`` (of the GPU's total memory, CUDA only),
            ``arena_mb`` (staging arena size in MiB).

    Raises:
        DeviceError: from :meth:`start` when CUDA is asked for but not available.
    """

    def __init__(self, cfg: DeviceConfig, lanes: int = 1) -> None:
        self.cfg = cfg
        self.lanes = lanes
        self.device = torch.device("cpu")
        self.streams: list[Any] = []
        self.started = False
        self.warmup_s: float | None = None
        self.arena_overflows = 0
        self._host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None
        self._local = threading.local()

    def bind_lane(self, lane: int) -> None:
        """Make the calling thread use lane ``lane``'s stream and arena slot."""
        if not 0 <= lane < self.lanes:
            raise ValueError(f"lane {lane} out of range (this runtime has {self.lanes})")
        self._local.lane = lane

    @property
    def lane(self) -> int:
        return getattr(self._local, "lane", 0)

    @property
    def stream(self) -> Any:
        """The calling thread's CUDA stream (``None`` on the CPU)."""
        return self.streams[self.lane] if self.streams else None

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
            self.streams = [torch.cuda.Stream(device=self.device) for _ in range(self.lanes)]
        nbytes = self.cfg.arena_mb * 1024 * 1024
        if nbytes:
            on_gpu = self.device.type == "cuda"
            self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu)
            if on_gpu:
                self._dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.started = True

    @contextlib.contextmanager
    def batch_context(self) -> Iterator[None]:
        """Run a batch: ``torch.inference_mode()`` and, on CUDA, the lane's own stream."""
        stream = self.stream
        with torch.inference_mode():
            if stream is None:
                yield
                return
            with torch.cuda.stream(stream):
                yield
            stream.synchronize()

    def stage(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Place a batch's input tensors on the device through the staging arena.

        Args:
            tensors: CPU tensors (any dtype/shape), e.g. token ids ``(B, T)`` int64 or pixels
                ``(B, 3, H, W)`` float32.

        Returns:
            Tensors of the same dtype and shape on ``self.device``. They are views into the
            arena, valid until the next :meth:`stage` call: the caller must be done with
            them by then (the engine runs one batch at a time per process).
        """
        if self._host is None:
            return [t.to(self.device, non_blocking=True) for t in tensors]
        sizes = [t.numel() * t.element_size() for t in tensors]
        total = sum(-(-n // _ALIGN) * _ALIGN for n in sizes)
        slot = (self._host.numel() // self.lanes) // _ALIGN * _ALIGN
        if total > slot:
            self.arena_overflows += 1
            return [t.to(self.device, non_blocking=True) for t in tensors]
        out: list[torch.Tensor] = []
        offset = self.lane * slot
        for t, n in zip(tensors, sizes, strict=True):
            host = self._host[offset : offset + n].view(t.dtype).view(t.shape)
            host.copy_(t)
            if self._dev is not None:
                dev = self._dev[offset : offset + n].view(t.dtype).view(t.shape)
                dev.copy_(host, non_blocking=True)  # on the current (worker's) stream
                out.append(dev)
            else:
                out.append(host)
            offset += -(-n // _ALIGN) * _ALIGN
        return out

    def warmup(self, fn: Callable[[], None]) -> float:
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
            "lanes": self.lanes,
            "stream": None,
            "memory_fraction": None,
            "arena_bytes": 0 if self._host is None else self._host.numel(),
            "arena_pinned": bool(self._host is not None and self._host.is_pinned()),
            "arena_overflows": self.arena_overflows,
            "warmup_s": self.warmup_s,
            "cuda_reserved_mb": None,
        }
        if self.streams:
            out["stream"] = [int(st.cuda_stream) for st in self.streams]
            out["memory_fraction"] = self.cfg.memory_fraction
            out["cuda_reserved_mb"] = torch.cuda.memory_reserved(self.device) / 2**20
        return out
