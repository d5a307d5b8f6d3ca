"""The transport bench's report: per-size summary, the report dict, and its tables.

``_size_summary`` turns one size's runs (ms per path, message bytes, Redis memory) into the
report's entry for that size (ratios to memcpy, the shm time's parts); ``done_when``,
``machine_facts`` and ``METHOD`` are the rest of the report; ``print_transport_report``
prints it as tables.
"""

from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from producer.tools.bench.stats import spread

MIB = 1 << 20
PATHS = ("shm", "shm_fresh", "inline")
SHM_OVER_INLINE_TARGET = 50.0  # done-when: shm at least 50x faster than inline (largest size)
SHM_OVER_MEMCPY_TARGET = 2.0  # done-when: shm within 2x of one memcpy (largest size)
METHOD = {
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
}


def size_label(nbytes: int) -> str:
    """``"1MB"``, ``"16MB"``, ``"128MB"`` for whole MiB (the report's keys), else ``"<n>B"``."""
    return f"{nbytes // MIB}MB" if nbytes % MIB == 0 else f"{nbytes}B"


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


def size_summary(
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


def done_when(sizes: dict[str, Any], largest: str) -> dict[str, Any]:
    """The done-when verdict at the ``largest`` size label (``None`` where unmeasured)."""
    big = sizes.get(largest, {})
    return {
        "size": largest,
        "inline_over_shm": big.get("inline_over_shm"),
        "shm_50x_faster_than_inline": _at_least(big.get("inline_over_shm"), SHM_OVER_INLINE_TARGET),
        "shm_over_memcpy": big.get("shm_over_memcpy"),
        "shm_within_2x_memcpy": _at_most(big.get("shm_over_memcpy"), SHM_OVER_MEMCPY_TARGET),
        "shm_fresh_over_memcpy": big.get("shm_fresh_over_memcpy"),
        "messages_under_64KB": all(
            (s.get("message_bytes_shm") or 1 << 30) < 64 * 1024 for s in sizes.values()
        ),
    }


def machine_facts(load_start: tuple[float, ...], load_end: tuple[float, ...]) -> dict[str, Any]:
    from producer.tools.bench.report import _cpu_model, _memory_gb

    return {
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "memory_gb": _memory_gb(),
        "kernel": os.uname().release,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "load_avg_start": list(load_start),
        "load_avg_end": list(load_end),
    }


def busy_warnings(load_start: tuple[float, ...]) -> list[str]:
    cores = os.cpu_count() or 1
    if load_start[0] <= 0.5 * cores:
        return []
    return [
        f"the machine was busy before the run (load average {load_start[0]:.2f} on "
        f"{cores} cores): other processes competed with the bench"
    ]


def size_line(label: str, s: dict[str, Any]) -> str:
    """One size's medians on one line, printed as the bench goes."""
    parts = [f"{p} {_f(s.get(f'{p}_ms'))} ms" for p in ("memcpy", *PATHS)]
    return f"  {label}: " + ", ".join(parts)


def _e2e_table(report: dict[str, Any]) -> Table:
    n = report["repetitions"]
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
    return t


def _parts_table(report: dict[str, Any]) -> Table:
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
    return p


def print_transport_report(report: dict[str, Any], console: Console | None = None) -> None:
    """The transport report as tables on stdout."""
    con = console or Console(width=150)
    con.print(
        f"[bold]bench {report['workload']}[/bold]: {report['repetitions']} repetitions per "
        f"size and path, {report['machine']['cores']} cores, {report['duration_s']} s"
    )
    con.print(_e2e_table(report))
    con.print(_parts_table(report))
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
