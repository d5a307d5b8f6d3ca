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

REALTIME preemption
-------------------
Two lanes on one device contend for it (on the CPU for cores and the GIL: a REALTIME
sentence beside a batch takes more than twice as long as alone; see docs/decisions.md,
"REALTIME preemption"). While the REALTIME
lane runs a batch (:meth:`DeviceRuntime.realtime_section`), the main lane pauses at its next
*yield point*: a forward pre-hook on every module inside the layers of every
``torch.nn.ModuleList`` of the model (:meth:`DeviceRuntime.install_yield_points`; a
transformer's encoder layers and their linear, attention and norm modules, a ResNet's
stages and their convolutions). So a REALTIME request shares the device for at most one
such op of a lower-priority batch (a few ms), never for the batch, and then has it alone.
The main lane also yields between a batch's phases (:meth:`DeviceRuntime.yield_now`). A
pause is bounded (``MAX_PAUSE_S``) so a stuck REALTIME batch cannot stall the main lane for
good. On CUDA the REALTIME lane's stream also gets the higher stream priority.

A model run through TorchScript (the text encoder by default) runs no Python hooks, so it has no
yield points inside; but it runs without the GIL, so the lanes no longer contend for it. There, and
everywhere with two lanes, the main lane's thread also runs at a higher nice value
(``main_lane_nice``, 5), so that a core it shares with the REALTIME lane or the event loop goes to
them first; and while REALTIME traffic flows its batches run on a ``SCHED_IDLE`` thread instead
(``workers.batching.batcher.IdleRunner``), which the kernel preempts for them at once, hooks or not.
That thread skips the yield points (:meth:`DeviceRuntime.mark_idle_class`): pausing there too would
only leave a core idle.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
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
REALTIME_LANE = 1  # lane index of the REALTIME inference thread (0: the main lane)
MAX_PAUSE_S = 2.0  # longest the main lane waits at one yield point for a REALTIME batch
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
        self._rt_cv = threading.Condition()
        self._rt_active = 0
        self.yield_points = 0
        self.main_lane_nice = 0  # the main lane thread's nice value once bound
        self.pauses = 0  # main-lane pauses for REALTIME batches, and their total time
        self.paused_s = 0.0

    # -- REALTIME preemption -----------------------------------------------------------
    def install_yield_points(self, modules: list[Any]) -> int:
        """Hook every module inside the layers of every ``torch.nn.ModuleList`` in
        ``modules``: the main lane pauses there while a REALTIME batch runs. Returns how many
        hooks were added."""
        seen: set[int] = set()
        hooks = 0
        for root in modules:
            for mod in root.modules():
                if not isinstance(mod, torch.nn.ModuleList):
                    continue
                for layer in mod:
                    for sub in layer.modules():  # every op-sized piece: pauses come sooner
                        if id(sub) in seen:
                            continue
                        seen.add(id(sub))
                        sub.register_forward_pre_hook(self._yield_point)
                        hooks += 1
        self.yield_points += hooks
        return hooks

    @contextlib.contextmanager
    def realtime_section(self) -> Iterator[None]:
        """Around a REALTIME lane batch: the main lane pauses at its next yield point."""
        with self._rt_cv:
            self._rt_active += 1
        try:
            yield
        finally:
            with self._rt_cv:
                self._rt_active -= 1
                if not self._rt_active:
                    self._rt_cv.notify_all()

    def yield_now(self) -> None:
        """A yield point outside the model (between a batch's phases): on the main lane,
        wait here while a REALTIME batch runs."""
        self._yield_point(None, None)

    @property
    def on_realtime_lane(self) -> bool:
        """True on the REALTIME lane's thread (a runtime with two lanes only)."""
        return self.lanes > 1 and self.lane == REALTIME_LANE

    def _yield_point(self, _module: Any, _args: Any) -> None:
        if not self._rt_active or self.lanes < 2 or self.on_realtime_lane:
            return
        if getattr(self._local, "idle_class", False):
            return  # the kernel preempts this thread for the REALTIME lane already
        t0 = time.perf_counter()
        with self._rt_cv:
            self._rt_cv.wait_for(lambda: not self._rt_active, timeout=MAX_PAUSE_S)
        self.pauses += 1
        self.paused_s += time.perf_counter() - t0

    def bind_lane(self, lane: int) -> None:
        """Make the calling thread use lane ``lane``'s stream and arena slot."""
        if not 0 <= lane < self.lanes:
            raise ValueError(f"lane {lane} out of range (this runtime has {self.lanes})")
        self._local.lane = lane
        if lane == 0 and self.lanes > 1 and self.cfg.main_lane_nice:
            self._renice_thread(self.cfg.main_lane_nice)

    def mark_idle_class(self) -> None:
        """The calling (main-lane) thread runs in ``SCHED_IDLE`` (``workers.batching.batcher``): it
        skips the yield points, since any normal thread preempts it anyway; pausing there
        too would only leave a core idle."""
        self._local.idle_class = True

    def _renice_thread(self, nice: int) -> None:
        """Give the calling thread its own nice value (Linux: per thread; raising it needs no
        privilege). Best effort: elsewhere, or if refused, it logs and goes on."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            self.main_lane_nice = nice
        except (OSError, AttributeError) as exc:
            log.warning("could not set the main lane's nice to %d: %s", nice, exc)

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
        sys.setswitchinterval(self.cfg.gil_switch_interval_ms / 1000.0)
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
            # Lower number = higher priority; lane 1 (REALTIME) gets the highest there is.
            _, high = torch.cuda.Stream.priority_range()
            self.streams = [
                torch.cuda.Stream(device=self.device, priority=high if i else 0)
                for i in range(self.lanes)
            ]
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
            "gil_switch_interval_ms": round(sys.getswitchinterval() * 1000.0, 3),
            "yield_points": self.yield_points,
            "main_lane_nice": self.main_lane_nice,
            "realtime_pauses": self.pauses,
            "realtime_paused_s": round(self.paused_s, 3),
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
