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
checksum (``shared.probe.byte_checksum``): a full read. Its in-process cost (``ShmStore.get``
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
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from producer.tools.bench.runner import BenchError, bench_stack
from producer.tools.bench.transport_env import (
    bench_shm_root,
    env_var,
    memcpy_ms,
    mount_of,
    ms,
    probe_read_ms,
    redis_facts,
    redis_memory,
    remove_root,
    shmem_hugepages,
    used_memory,
)
from producer.tools.bench.transport_report import (
    METHOD,
    PATHS,
    PathRun,
    busy_warnings,
    done_when,
    machine_facts,
    print_transport_report,
    size_label,
    size_line,
    size_summary,
)
from producer.tools.bench.workload import REPO, Workload
from shared.probe import byte_checksum

PEEK_QUEUE = "peek"  # as long as "text": a peeked message has the real message's length
MIN_MEMCPY_REPS = 5
RESULT_TIMEOUT_S = 600.0


def is_transport(w: Workload) -> bool:
    """Whether ``w`` is a tensor-transport workload (it has a ``tensor`` source)."""
    return any(s.kind == "tensor" for s in w.sources.values())


def tensor_of(nbytes: int, seed: int = 0) -> np.ndarray:
    """A random float32 tensor of exactly ``nbytes`` (uint8 when not a multiple of 4)."""
    rng = np.random.default_rng(seed)
    if nbytes % 4 == 0:
        return rng.standard_normal(nbytes // 4, dtype=np.float32)
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


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
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        run_dir = self.run_dir or (REPO / ".run" / "bench" / f"{self.w.name}-{stamp}")
        shm_root = bench_shm_root()
        started = datetime.now(UTC).isoformat()
        load_start = os.getloadavg()
        t_start = time.monotonic()
        try:
            with (
                env_var("FLEET_TRANSPORT__SHM_ROOT", str(shm_root)),
                bench_stack(self.w, run_dir, self._step) as (settings, stack),
            ):
                with self._step("starting a text worker"):
                    stack.start_worker("text", "batch")
                body = self._measure(settings)
        finally:
            left = remove_root(shm_root)
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
        facts = redis_facts(redis)
        sizes: dict[str, Any] = {}
        try:
            for n in self.sizes:
                label = size_label(n)
                # No spinner while measuring: its thread would take CPU from the paths.
                self.console.print(f"{label}: memcpy, shm, shm fresh, inline ...")
                sizes[label] = self._one_size(n, client, redis, store, fresh)
                self.console.print(size_line(label, sizes[label]))
            facts["used_memory_end"] = used_memory(redis)
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
            "shm_filesystem": {**mount_of(store.root), "shmem_enabled": shmem_hugepages()},
            "shm_files_before": files_before,
            "shm_files_after": files_after,
        }

    def _one_size(
        self, nbytes: int, client: Any, redis: Any, store: Any, fresh: Any
    ) -> dict[str, Any]:
        arr = tensor_of(nbytes)
        expected = byte_checksum(arr)
        n_fast = max(self.reps, MIN_MEMCPY_REPS)
        memcpy = memcpy_ms(arr, n_fast)
        read = probe_read_ms(store, self._reader, arr, n_fast)
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
                before = redis_memory(redis)
                for _ in range(self.reps):
                    send()
                after = redis_memory(redis)
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
        return size_summary(nbytes, arr, memcpy, read, runs, mem, store)

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
        from shared.probe import PROBE_TASK
        from shared.transport import encode_inline

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
            run.e2e_ms.append(ms(t2 - t0))
            run.encode_ms.append(ms(t1 - t0))
            run.release_ms.append(ms(t4 - t3))

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
            run.e2e_ms.append(ms(t2 - t0))
            run.encode_ms.append(ms(t1 - t0))

        if path == "shm":
            return lambda: via_shm(store)
        if path == "shm_fresh":
            return lambda: via_shm(fresh)
        return via_inline

    def _peek_bytes(
        self, path: str, arr: np.ndarray, client: Any, redis: Any, store: Any, fresh: Any
    ) -> int:
        """Length of the raw message this path puts into Redis (sent to a queue nobody reads)."""
        from shared.probe import PROBE_TASK
        from shared.transport import encode_inline

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
        from producer.tools.bench.report import report_head

        verdict = done_when(body["transport"], size_label(max(self.sizes)))
        load_end = os.getloadavg()
        return {
            **report_head(self.w, started, duration_s),
            "repetitions": self.reps,
            "run_dir": str(run_dir),
            "machine": machine_facts(load_start, load_end),
            "method": dict(METHOD),
            **body,
            "done_when": verdict,
            "warnings": [*self.notes, *busy_warnings(load_start)],
        }


def run_transport(
    w: Workload,
    repetitions: int,
    out_dir: Path,
    run_dir: Path | None,
    err: Console,
) -> int:
    """``fleet bench transport``: run, write ``reports/bench`` files, print; exit status."""
    from producer.tools.bench.report import run_reported

    bench = TransportBench(w, repetitions, run_dir, console=err)
    return run_reported(bench.run, print_transport_report, out_dir, err)
