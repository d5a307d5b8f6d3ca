"""``fleet bench transport``: one tensor producer -> worker -> result, via /dev/shm and inline.

For each size of the workload's ``tensor`` source (1, 16 and 128 MiB float32 in
``configs/workloads/transport.toml``) and each path, one warmup send (unmeasured) and then
``repetitions`` sends one at a time (closed loop, concurrency 1), each timed on the producer's
``perf_counter`` from before the tensor is handed to the transport until the probe's result
has been received:

- ``shm``: the product's path. ``ShmStore.put(detach=True)`` (the producer's store from
  ``[transport]`` settings: by default a recycling store, so a released segment's file is
  rewritten by the next put of its size, and the worker's reader cache keeps its mapping of
  that file) + ``send_task(fleet.transport_probe)`` with the ``TensorRef`` + ``result.get``.
  The segment is released after the clock stops (its time is given apart).
- ``shm_fresh``: the same with a store that does not recycle (``recycle_bytes = 0``): every
  put allocates new tmpfs pages and every read faults them in. Measured to show what
  recycling buys.
- ``inline``: ``encode_inline`` (base64 in the message) + ``send_task`` + ``result.get``. The
  product refuses inline tensors above ``limits.max_inline_bytes`` (8 MiB); the bench passes
  the tensor's own size as the limit to measure the path anyway. The worker's probe accepts
  up to 64 x ``max_inline_bytes``. Whatever refuses (Redis, the worker) is reported as the
  outcome of that size instead of a time.
- ``memcpy``: ``np.copyto`` of the same bytes into a preallocated, already-touched array in
  the producer process: the physical floor of moving the bytes once. Best of
  ``max(repetitions, 5)``.

The worker (``fleet.transport_probe``) maps or decodes the tensor and reads every byte into a
checksum (``workers.probe.byte_checksum``): a full read. Its in-process cost (``ShmStore.get``
+ the same checksum, in the producer, best of N) is given as ``probe_read_ms``, so that the
path itself (``shm_ms - probe_read_ms``, its ratio to memcpy in ``shm_path_over_memcpy``)
can be told from the probe's own work.

Messages: each path's raw Redis message is measured by sending one probe to a queue nobody
consumes (``peek``, as long a name as ``text``, so the bytes are the real message's), reading
it back (``LRANGE``) and deleting it. Redis memory: ``used_memory`` less the clients' I/O
buffers (see :func:`_memory`) before and after each measured series (results are deleted
with ``forget()`` after each request, so nothing else stays behind), and its peak.

The stack is its own: Redis and one text worker (the probe is registered on every worker and
the ``text`` queue is consumed by it) on free ports in ``.run/bench/transport-<time>``, with a
shared-memory root of its own (``/dev/shm/mmfleet-<uid>-bench-<pid>``), removed at the end;
files left in it are reported.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from producer.bench.runner import BenchError, bench_environment
from producer.bench.stats import spread
from producer.bench.workload import REPO, Workload
from workers.probe import byte_checksum

PATHS = ("shm", "shm_fresh", "inline")
PEEK_QUEUE = "peek"  # as long as "text": a peeked message has the real message's length
MIN_MEMCPY_REPS = 5
RESULT_TIMEOUT_S = 600.0
SHM_OVER_INLINE_TARGET = 50.0  # done-when: shm at least 50x faster than inline (largest size)
SHM_OVER_MEMCPY_TARGET = 2.0  # done-when: shm within 2x of one memcpy (largest size)
MIB = 1 << 20


def is_transport(w: Workload) -> bool:
    """Whether ``w`` is a tensor-transport workload (it has a ``tensor`` source)."""
    return any(s.kind == "tensor" for s in w.sources.values())


def size_label(nbytes: int) -> str:
    """``"1MB"``, ``"16MB"``, ``"128MB"`` for whole MiB (the report's keys), else ``"<n>B"``."""
    return f"{nbytes // MIB}MB" if nbytes % MIB == 0 else f"{nbytes}B"


def tensor_of(nbytes: int, seed: int = 0) -> np.ndarray:
    """A random float32 tensor of exactly ``nbytes`` (uint8 when not a multiple of 4)."""
    rng = np.random.default_rng(seed)
    if nbytes % 4 == 0:
        return rng.standard_normal(nbytes // 4, dtype=np.float32)
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def _ms(seconds: float) -> float:
    return seconds * 1e3


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


@dataclass
class PathRun:
    """One path at one size: end-to-end times and the parts the producer can see."""

    e2e_ms: list[float] = field(default_factory=list)
    encode_ms: list[float] = field(default_factory=list)  # put, or encode_inline
    release_ms: list[float] = field(default_factory=list)
    message_bytes: int | None = None
    error: str | None = None

    def median(self) -> float | None:
        return statistics.median(self.e2e_ms) if self.e2e_ms else None


class TransportBench:
    """Runs the transport workload; :meth:`run` returns the report (a JSON-able dict)."""

    def __init__(
        self,
        workload: Workload,
        repetitions: int = 0,
        run_dir: Path | None = None,
        console: Console | None = None,
    ) -> None:
        self.w = workload
        self.reps = max(3, repetitions or workload.repetitions)
        self.sizes = sorted(
            {n for s in workload.sources.values() if s.kind == "tensor" for n in s.sizes_bytes}
        )
        if not self.sizes or min(self.sizes) <= 0:
            raise BenchError("the transport workload needs positive sizes_bytes")
        self.run_dir = run_dir
        self.console = console or Console(stderr=True)
        self.notes: list[str] = []
        self._reader: Any = None  # a worker-like store, set in _measure

    # -- whole run ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Start Redis + a text worker, measure every size and path, stop everything.

        Raises:
            BenchError: Redis or the worker did not start.
        """
        from producer.stack import Stack, StackError

        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        run_dir = self.run_dir or (REPO / ".run" / "bench" / f"{self.w.name}-{stamp}")
        shm_root = bench_shm_root()
        started = datetime.now(UTC).isoformat()
        load_start = os.getloadavg()
        t_start = time.monotonic()
        with (
            _env("FLEET_TRANSPORT__SHM_ROOT", str(shm_root)),
            bench_environment(self.w, run_dir) as settings,
        ):
            stack = Stack(settings)
            stack.prepare()
            try:
                with self._step("starting Redis and a text worker"):
                    stack.start_redis()
                    stack.start_worker("text", "batch")
                body = self._measure(settings)
            except StackError as exc:
                raise BenchError(str(exc)) from None
            finally:
                with self._step("stopping the stack"):
                    stack.down()
                shutil.rmtree(run_dir / "redis", ignore_errors=True)
                left = _remove_root(shm_root)
        body["shm_root_left_after_stop"] = left
        if left:
            self.notes.append(f"files were left in the bench's shm root after the run: {left}")
        return self._report(body, started, run_dir, load_start, time.monotonic() - t_start)

    @contextlib.contextmanager
    def _step(self, what: str) -> Iterator[None]:
        t0 = time.monotonic()
        with self.console.status(what):
            yield
        self.console.print(f"{what}: done in {time.monotonic() - t0:.1f} s")

    # -- measuring --------------------------------------------------------------------------
    def _measure(self, settings: Any) -> dict[str, Any]:
        from producer.client import FleetClient
        from shared.transport import ShmStore, store_from_settings

        client = FleetClient(settings, role="admin")  # it reads CLIENT LIST (memory)
        redis = client.app.backend.client
        store = store_from_settings(settings)
        fresh = ShmStore(
            store.root, capacity_bytes=store.capacity_bytes, default_ttl_s=store.default_ttl_s
        )
        self._reader = store_from_settings(settings, role="worker")  # as the probe reads
        if store.recycle_bytes < max(self.sizes):
            self.notes.append(
                f"[transport] recycle_bytes ({store.recycle_bytes} B) is smaller than the "
                "largest tensor: its shm path does not recycle"
            )
        files_before = sorted(os.listdir(store.root))
        facts = _redis_facts(redis)
        sizes: dict[str, Any] = {}
        try:
            for n in self.sizes:
                label = size_label(n)
                # No spinner while measuring: its thread would take CPU from the paths.
                self.console.print(f"{label}: memcpy, shm, shm fresh, inline ...")
                sizes[label] = self._one_size(n, client, redis, store, fresh)
                self._print_size(label, sizes[label])
            facts["used_memory_end"] = _used_memory(redis)
        finally:
            store.trim_pool()
            store.gc()
            store.close()
            self._reader.close()
            files_after = sorted(os.listdir(store.root))
            client.app.close()
        return {
            "redis": facts,
            "transport": sizes,
            "shm_root": str(store.root),
            "shm_filesystem": {**mount_of(store.root), "shmem_enabled": _shmem_hugepages()},
            "shm_files_before": files_before,
            "shm_files_after": files_after,
        }

    def _one_size(
        self, nbytes: int, client: Any, redis: Any, store: Any, fresh: Any
    ) -> dict[str, Any]:
        arr = tensor_of(nbytes)
        expected = byte_checksum(arr)
        n_fast = max(self.reps, MIN_MEMCPY_REPS)
        memcpy = _memcpy_ms(arr, n_fast)
        read = _probe_read_ms(store, self._reader, arr, n_fast)
        runs: dict[str, PathRun] = {}
        mem: dict[str, Any] = {}
        for path in PATHS:
            run = runs[path] = PathRun()
            try:
                run.message_bytes = self._peek_bytes(path, arr, client, redis, store, fresh)
                send = self._sender(path, arr, client, store, fresh, run, expected)
                send()  # warmup, unmeasured
                run.e2e_ms.clear()
                run.encode_ms.clear()
                run.release_ms.clear()
                before = _memory(redis)
                for _ in range(self.reps):
                    send()
                after = _memory(redis)
                mem[path] = {
                    "used_memory_before": before["used_memory"],
                    "used_memory_after": after["used_memory"],
                    "used_memory_delta": after["used_memory"] - before["used_memory"],
                    "less_clients_delta": after["less_clients"] - before["less_clients"],
                    "used_memory_peak_before": before["used_memory_peak"],
                    "used_memory_peak_after": after["used_memory_peak"],
                }
            except Exception as exc:  # a refusal is the outcome of this size, not a crash
                run.error = f"{type(exc).__name__}: {str(exc)[:300]}"
                self.notes.append(f"{size_label(nbytes)} {path}: {run.error}")
                with contextlib.suppress(Exception):
                    client.app.control.purge()
        return _size_summary(nbytes, arr, memcpy, read, runs, mem, store)

    def _sender(
        self,
        path: str,
        arr: np.ndarray,
        client: Any,
        store: Any,
        fresh: Any,
        run: PathRun,
        expected: float,
    ) -> Callable[[], None]:
        from shared.transport import encode_inline
        from workers.probe import PROBE_TASK

        app = client.app

        def check(out: dict[str, Any]) -> None:
            ok = out.get("nbytes") == arr.nbytes and out.get("checksum") == expected
            if not ok:
                raise BenchError(f"the probe read something else: {out}")

        def via_shm(st: Any) -> None:
            t0 = time.perf_counter()
            ref = st.put(arr, detach=True)
            t1 = time.perf_counter()
            res = app.send_task(PROBE_TASK, kwargs={"tensor": ref.to_dict()}, queue="text")
            try:
                out = res.get(timeout=RESULT_TIMEOUT_S)
                t2 = time.perf_counter()
            finally:
                t3 = time.perf_counter()
                st.release(ref)
                t4 = time.perf_counter()
                res.forget()
            check(out)
            run.e2e_ms.append(_ms(t2 - t0))
            run.encode_ms.append(_ms(t1 - t0))
            run.release_ms.append(_ms(t4 - t3))

        def via_inline() -> None:
            t0 = time.perf_counter()
            wire = encode_inline(arr, max_bytes=arr.nbytes)
            t1 = time.perf_counter()
            res = app.send_task(PROBE_TASK, kwargs={"tensor": wire}, queue="text")
            del wire
            try:
                out = res.get(timeout=RESULT_TIMEOUT_S)
                t2 = time.perf_counter()
            finally:
                res.forget()
            check(out)
            run.e2e_ms.append(_ms(t2 - t0))
            run.encode_ms.append(_ms(t1 - t0))

        if path == "shm":
            return lambda: via_shm(store)
        if path == "shm_fresh":
            return lambda: via_shm(fresh)
        return via_inline

    def _peek_bytes(
        self, path: str, arr: np.ndarray, client: Any, redis: Any, store: Any, fresh: Any
    ) -> int:
        """Length of the raw message this path puts into Redis (sent to a queue nobody reads)."""
        from shared.transport import encode_inline
        from workers.probe import PROBE_TASK

        ref = res = None
        if path == "inline":
            wire = encode_inline(arr, max_bytes=arr.nbytes)
        else:
            ref = (store if path == "shm" else fresh).put(arr, detach=True)
            wire = ref.to_dict()
        try:
            res = client.app.send_task(PROBE_TASK, kwargs={"tensor": wire}, queue=PEEK_QUEUE)
            del wire
            keys = [
                k
                for k in redis.scan_iter(match=f"{PEEK_QUEUE}*")
                if redis.type(k) in (b"list", "list")
            ]
            lengths = [len(m) for k in keys for m in redis.lrange(k, 0, -1)]
            if len(lengths) != 1:
                raise BenchError(f"expected one peeked message, found {len(lengths)}")
            return lengths[0]
        finally:
            for k in redis.scan_iter(match=f"{PEEK_QUEUE}*"):
                redis.delete(k)
            redis.delete(f"_kombu.binding.{PEEK_QUEUE}", f"_kombu.binding_permanent.{PEEK_QUEUE}")
            if res is not None:
                res.forget()
            if ref is not None:
                (store if path == "shm" else fresh).release(ref)

    # -- report -----------------------------------------------------------------------------
    def _report(
        self,
        body: dict[str, Any],
        started: str,
        run_dir: Path,
        load_start: tuple[float, ...],
        duration_s: float,
    ) -> dict[str, Any]:
        from producer.bench.report import SCHEMA_VERSION, _cpu_model, _memory_gb

        sizes = body["transport"]
        largest = size_label(max(self.sizes))
        big = sizes.get(largest, {})
        done_when = {
            "size": largest,
            "inline_over_shm": big.get("inline_over_shm"),
            "shm_50x_faster_than_inline": _at_least(big.get("inline_over_shm"), 50.0),
            "shm_over_memcpy": big.get("shm_over_memcpy"),
            "shm_within_2x_memcpy": _at_most(big.get("shm_over_memcpy"), 2.0),
            "shm_fresh_over_memcpy": big.get("shm_fresh_over_memcpy"),
            "messages_under_64KB": all(
                (s.get("message_bytes_shm") or 1 << 30) < 64 * 1024 for s in sizes.values()
            ),
        }
        load_end = os.getloadavg()
        warnings = list(self.notes)
        cores = os.cpu_count() or 1
        if load_start[0] > 0.5 * cores:
            warnings.append(
                f"the machine was busy before the run (load average {load_start[0]:.2f} on "
                f"{cores} cores): other processes competed with the bench"
            )
        return {
            "schema": SCHEMA_VERSION,
            "workload": self.w.name,
            "description": self.w.description,
            "workload_spec": self.w.model_dump(mode="json"),
            "started_utc": started,
            "finished_utc": datetime.now(UTC).isoformat(),
            "duration_s": round(duration_s, 1),
            "repetitions": self.reps,
            "run_dir": str(run_dir),
            "machine": {
                "cores": os.cpu_count(),
                "cpu": _cpu_model(),
                "memory_gb": _memory_gb(),
                "kernel": os.uname().release,
                "python": sys.version.split()[0],
                "numpy": np.__version__,
                "load_avg_start": list(load_start),
                "load_avg_end": list(load_end),
            },
            "method": {
                "e2e": "producer perf_counter, from before put/encode to the result received "
                "(closed loop, one request at a time, one warmup send per size and path)",
                "ms": "median of the repetitions; spread gives min/median/max",
                "memcpy_ms": "np.copyto into a preallocated, touched array; best of N",
                "shm_over_memcpy": "median shm_ms / memcpy_ms",
                "probe_read_ms": "ShmStore.get + byte_checksum in the producer, best of N: "
                "the probe's own work on a mapped tensor",
                "message_bytes": "raw Redis list entry (LRANGE of a probe sent to an "
                "unconsumed queue of the same name length)",
                "inline_limit": "raised to the tensor's size (the product refuses > 8 MiB)",
            },
            **body,
            "done_when": done_when,
            "warnings": warnings,
        }

    def _print_size(self, label: str, s: dict[str, Any]) -> None:
        parts = [f"{p} {_f(s.get(f'{p}_ms'))} ms" for p in ("memcpy", *PATHS)]
        self.console.print(f"  {label}: " + ", ".join(parts))


# -- helpers ----------------------------------------------------------------------------------
def bench_shm_root() -> Path:
    """The bench's own shm root: beside ``FLEET_TRANSPORT__SHM_ROOT`` when that is set (e.g.
    on a tmpfs mounted with ``huge=within_size``), else in ``/dev/shm``."""
    configured = os.environ.get("FLEET_TRANSPORT__SHM_ROOT")
    parent = Path(configured).parent if configured else Path("/dev/shm")
    return parent / f"mmfleet-{os.getuid()}-bench-{os.getpid()}"


def mount_of(path: Path) -> dict[str, str]:
    """Mount point, filesystem type and options of the filesystem holding ``path``."""
    best = {"mountpoint": "", "fstype": "?", "options": "?"}
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    target = str(path.resolve())
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        mp = parts[1]
        inside = target == mp or target.startswith(mp.rstrip("/") + "/")
        if inside and len(mp) >= len(best["mountpoint"]):
            best = {"mountpoint": mp, "fstype": parts[2], "options": parts[3]}
    return best


def _shmem_hugepages() -> str | None:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip()
    except OSError:
        return None


@contextlib.contextmanager
def _env(key: str, value: str) -> Iterator[None]:
    saved = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


def _remove_root(root: Path) -> list[str]:
    """Remove the bench's shm root; return what was still in it."""
    try:
        left = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    shutil.rmtree(root, ignore_errors=True)
    return left


def _memcpy_ms(arr: np.ndarray, n: int) -> dict[str, float]:
    dst = np.empty_like(arr)
    np.copyto(dst, arr)  # touch every page of the destination first
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        np.copyto(dst, arr)
        ts.append(_ms(time.perf_counter() - t0))
    return {"best": min(ts), "median": statistics.median(ts)}


def _probe_read_ms(store: Any, reader: Any, arr: np.ndarray, n: int) -> float:
    """The probe's own work in-process: ``reader.get`` (a store set up as a worker's, reader
    cache included) + the checksum of a segment ``store`` wrote; best of ``n``."""
    ref = store.put(arr, detach=True)
    try:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            view = reader.get(ref)
            byte_checksum(view)
            del view
            ts.append(_ms(time.perf_counter() - t0))
    finally:
        store.release(ref)
    return min(ts)


def _memory(redis: Any) -> dict[str, int]:
    """``used_memory``, its peak, and ``used_memory`` less every client's I/O buffers.

    Read atomically (MULTI). Raw ``used_memory`` moves by 32-64 KiB several times a second on
    an idle stack (query buffers allocated per command, freed when a client idles); without
    the clients' ``tot-mem`` it holds still to within a few hundred bytes.
    """
    pipe = redis.pipeline(transaction=True)
    pipe.info("memory")
    pipe.client_list()
    info, clients = pipe.execute()
    used = int(info["used_memory"])
    return {
        "used_memory": used,
        "used_memory_peak": int(info["used_memory_peak"]),
        "less_clients": used - sum(int(c.get("tot-mem", 0)) for c in clients),
    }


def _used_memory(redis: Any) -> int:
    return _memory(redis)["used_memory"]


def _redis_facts(redis: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"version": str(redis.info("server")["redis_version"])}
    for key in ("proto-max-bulk-len", "client-query-buffer-limit", "maxmemory", "appendonly"):
        try:
            val = redis.config_get(key).get(key)
        except Exception as exc:  # CONFIG may be renamed or refused
            val = f"unavailable ({type(exc).__name__})"
        out[key.replace("-", "_")] = int(val) if isinstance(val, str) and val.isdigit() else val
    out["used_memory_start"] = _used_memory(redis)
    return out


def _size_summary(
    nbytes: int,
    arr: np.ndarray,
    memcpy: dict[str, float],
    read_ms: float,
    runs: dict[str, PathRun],
    mem: dict[str, Any],
    store: Any,
) -> dict[str, Any]:
    shm, rec, inl = runs["shm"], runs["shm_fresh"], runs["inline"]
    m = memcpy["best"]
    out: dict[str, Any] = {
        "nbytes": nbytes,
        "dtype": str(arr.dtype),
        "memcpy_ms": m,
        "memcpy_median_ms": memcpy["median"],
        "shm_ms": shm.median(),
        "shm_fresh_ms": rec.median(),
        "inline_ms": inl.median(),
        "shm_over_memcpy": _ratio(shm.median(), m),
        "shm_min_over_memcpy": _ratio(min(shm.e2e_ms, default=None), m),
        "shm_fresh_over_memcpy": _ratio(rec.median(), m),
        # The path alone: end to end less the probe's own full read of the mapped bytes
        # (its consumer work, the same whatever the transport).
        "shm_path_over_memcpy": _ratio(_less(shm.median(), read_ms), m),
        "shm_fresh_path_over_memcpy": _ratio(_less(rec.median(), read_ms), m),
        "inline_over_shm": _ratio(inl.median(), shm.median()),
        "inline_over_shm_fresh": _ratio(inl.median(), rec.median()),
        "message_bytes_shm": shm.message_bytes,
        "message_bytes_shm_fresh": rec.message_bytes,
        "message_bytes_inline": inl.message_bytes,
        "probe_read_ms": read_ms,
        "put_ms": _median(shm.encode_ms),
        "put_fresh_ms": _median(rec.encode_ms),
        "put_over_memcpy": _ratio(_median(shm.encode_ms), m),
        "put_fresh_over_memcpy": _ratio(_median(rec.encode_ms), m),
        "encode_inline_ms": _median(inl.encode_ms),
        "release_ms": _median(shm.release_ms),
        # What is left of the shm time once the put and the probe's own read are taken out:
        # messaging (broker, result store) and mapping.
        "shm_rest_ms": _rest(shm.median(), _median(shm.encode_ms), read_ms),
        "spread_ms": {p: spread(r.e2e_ms) for p, r in runs.items()},
        "samples_ms": {p: [round(x, 3) for x in r.e2e_ms] for p, r in runs.items()},
        "redis_memory": mem,
        # used_memory less clients' I/O buffers, after the measured series minus before.
        "redis_memory_delta_shm": mem.get("shm", {}).get("less_clients_delta"),
        "redis_memory_delta_inline": mem.get("inline", {}).get("less_clients_delta"),
        "redis_peak_inline": mem.get("inline", {}).get("used_memory_peak_after"),
        "errors": {p: r.error for p, r in runs.items() if r.error},
        "pool_bytes_after": store.pool_bytes(),
    }
    return out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _less(total: float | None, part: float) -> float | None:
    return None if total is None else total - part


def _rest(total: float | None, put: float | None, read: float) -> float | None:
    return None if total is None or put is None else total - put - read


def _at_least(x: float | None, target: float) -> bool | None:
    return None if x is None else x >= target


def _at_most(x: float | None, target: float) -> bool | None:
    return None if x is None else x <= target


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 10 * 1024:
        return f"{n} B"
    if n < 10 * MIB:
        return f"{n / 1024:.1f} KiB"
    return f"{n / MIB:.1f} MiB"


# -- output -----------------------------------------------------------------------------------
def print_transport_report(report: dict[str, Any], console: Console | None = None) -> None:
    """The transport report as tables on stdout."""
    con = console or Console(width=150)
    n = report["repetitions"]
    con.print(
        f"[bold]bench {report['workload']}[/bold]: {n} repetitions per size and path, "
        f"{report['machine']['cores']} cores, {report['duration_s']} s"
    )
    t = Table(title=f"Producer -> worker -> result, ms (median of {n}; memcpy: best)")
    cols = ("size", "memcpy", "shm", "shm fresh", "inline", "shm/memcpy",
            "fresh/memcpy", "inline/shm", "msg shm", "msg inline")  # fmt: skip
    for c in cols:
        t.add_column(c, justify="left" if c == "size" else "right")
    for label, s in report["transport"].items():
        sp = s.get("spread_ms", {})

        def cell(path: str, s: dict[str, Any] = s, sp: dict[str, Any] = sp) -> str:
            if s.get("errors", {}).get(path):
                return "[red]refused[/red]"
            r = sp.get(path)
            rng = f" ({r['min']:.1f}-{r['max']:.1f})" if r else ""
            return _f(s.get(f"{path}_ms")) + rng

        t.add_row(
            label,
            _f(s.get("memcpy_ms"), ".2f"),
            cell("shm"),
            cell("shm_fresh"),
            cell("inline"),
            _f(s.get("shm_over_memcpy"), ".2f"),
            _f(s.get("shm_fresh_over_memcpy"), ".2f"),
            _f(s.get("inline_over_shm"), ".1f"),
            _bytes(s.get("message_bytes_shm")),
            _bytes(s.get("message_bytes_inline")),
        )
    con.print(t)
    p = Table(title="Where the shm time goes, ms (medians; read = the probe's own get + checksum)")
    for c in ("size", "put", "put fresh", "probe read", "rest", "release", "encode inline",
              "redis memory delta, shm series (B)"):  # fmt: skip
        p.add_column(c, justify="left" if c == "size" else "right")
    for label, s in report["transport"].items():
        p.add_row(
            label,
            _f(s.get("put_ms"), ".2f"),
            _f(s.get("put_fresh_ms"), ".2f"),
            _f(s.get("probe_read_ms"), ".2f"),
            _f(s.get("shm_rest_ms"), ".2f"),
            _f(s.get("release_ms"), ".2f"),
            _f(s.get("encode_inline_ms"), ".1f"),
            str(s.get("redis_memory_delta_shm")),
        )
    con.print(p)
    d = report["done_when"]
    con.print(
        f"done-when at {d['size']}: inline/shm {_f(d['inline_over_shm'])}x "
        f"(>= 50x: {d['shm_50x_faster_than_inline']}); shm/memcpy "
        f"{_f(d['shm_over_memcpy'], '.2f')}x (<= 2x: {d['shm_within_2x_memcpy']}); "
        f"(fresh files: {_f(d['shm_fresh_over_memcpy'], '.2f')}x); shm messages < 64 KB: "
        f"{d['messages_under_64KB']}"
    )
    for wmsg in report.get("warnings", []):
        con.print(f"[yellow]warning:[/yellow] {wmsg}")
    for k, v in report.get("files", {}).items():
        con.print(f"{k}: {v}")


def run_transport(
    w: Workload,
    repetitions: int,
    out_dir: Path,
    run_dir: Path | None,
    err: Console,
) -> int:
    """``fleet bench transport``: run, write ``reports/bench`` files, print; exit status."""
    from producer.bench.report import write_report

    try:
        report = TransportBench(w, repetitions, run_dir, console=err).run()
    except BenchError as exc:
        err.print(f"[red]bench failed:[/red] {exc}")
        return 1
    write_report(report, out_dir, plot=False)
    print_transport_report(report, Console(file=sys.stdout, width=150))
    return 0
