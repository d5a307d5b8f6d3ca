"""What the transport bench measures around the paths: its shm root and the filesystem under
it, the in-process floors (memcpy, the probe's own read) and Redis memory.

Times in ms (``perf_counter``); memory in bytes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from shared.probe import byte_checksum


def ms(seconds: float) -> float:
    return seconds * 1e3


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


def shmem_hugepages() -> str | None:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip()
    except OSError:
        return None


@contextlib.contextmanager
def env_var(key: str, value: str) -> Iterator[None]:
    saved = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


def remove_root(root: Path) -> list[str]:
    """Remove the bench's shm root; return what was still in it."""
    try:
        left = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    shutil.rmtree(root, ignore_errors=True)
    return left


def memcpy_ms(arr: np.ndarray, n: int) -> dict[str, float]:
    dst = np.empty_like(arr)
    np.copyto(dst, arr)  # touch every page of the destination first
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        np.copyto(dst, arr)
        ts.append(ms(time.perf_counter() - t0))
    return {"best": min(ts), "median": statistics.median(ts)}


def probe_read_ms(store: Any, reader: Any, arr: np.ndarray, n: int) -> float:
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
            ts.append(ms(time.perf_counter() - t0))
    finally:
        store.release(ref)
    return min(ts)


def redis_memory(redis: Any) -> dict[str, int]:
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


def used_memory(redis: Any) -> int:
    return redis_memory(redis)["used_memory"]


def redis_facts(redis: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"version": str(redis.info("server")["redis_version"])}
    for key in ("proto-max-bulk-len", "client-query-buffer-limit", "maxmemory", "appendonly"):
        try:
            val = redis.config_get(key).get(key)
        except Exception as exc:  # CONFIG may be renamed or refused
            val = f"unavailable ({type(exc).__name__})"
        out[key.replace("-", "_")] = int(val) if isinstance(val, str) and val.isdigit() else val
    out["used_memory_start"] = used_memory(redis)
    return out
