"""``fleet soak``: memory stays flat under a long run of real requests.

Starts a stack of its own (Redis + one text worker, no Flower) in its own run directory on
free loopback ports, warms the worker up, then sends ``requests`` real sentences
(``data/text/botchan_sentences.txt``, cycled) in waves (``submit_many`` of ``wave`` requests,
then ``wait_all``), so the queue never holds more than one wave. After the warmup and after
every wave it reads the worker's resident set size (``VmRSS`` in ``/proc/<pid>/status``; the
pid in ``pids/worker-text.pid`` is the Celery worker itself: ``fleet worker`` execs Celery and
the solo pool runs tasks in that process). Writes ``reports/soak.json``::

    requests, warmup_requests, wave_size, waves, errors, error_codes, timeouts,
    rss_mb_start (after warmup), rss_mb_end, rss_mb_max, rss_growth_pct, rss_samples,
    cuda_reserved_mb_start/end (from the worker's ``fleet_stats``; null on CPU),
    duration_s, throughput_rps, worker facts, load average.

The stack is always stopped again, also on errors or Ctrl-C. Memory growth is a benchmark
figure, not a pass/fail criterion here: exit status 0 means the run completed and every
request succeeded, 1 that the stack did not start or some request failed or timed out.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from producer.stack.local import isolated_environment

REPO = Path(__file__).resolve().parents[2]
SENTENCES = REPO / "data" / "text" / "botchan_sentences.txt"
REPORT = REPO / "reports" / "soak.json"
WORKER = "worker-text"


class SoakError(RuntimeError):
    """The soak could not run (stack did not start, worker pid unreadable, ...)."""


@dataclass
class SoakOptions:
    """What one soak run does. ``run_dir=None``: a temporary directory, removed after."""

    requests: int = 10_000
    warmup: int = 500
    wave: int = 500
    priority: str = "bulk"  # no deadline: a slow, shared machine must not expire requests
    wave_timeout_s: float = 600.0
    sentences: Path = SENTENCES
    out: Path | None = REPORT
    run_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)  # extra FLEET_* overrides


# -- small pure helpers ---------------------------------------------------------------------
def load_sentences(path: Path = SENTENCES, min_chars: int = 3) -> list[str]:
    """Non-empty lines of at least ``min_chars`` characters.

    Raises:
        SoakError: the file has none.
    """
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    out = [ln for ln in lines if len(ln) >= min_chars]
    if not out:
        raise SoakError(f"no sentences in {path}")
    return out


def read_rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (``VmRSS`` from ``/proc/<pid>/status``).

    Raises:
        SoakError: the process is gone or has no VmRSS line (a zombie).
    """
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError as exc:
        raise SoakError(f"cannot read /proc/{pid}/status: {exc}") from None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            parts = line.split()
            return int(parts[1]) / 1024.0  # kB -> MiB
    raise SoakError(f"process {pid} has no VmRSS (exited?)")


def process_cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def malloc_env(pid: int) -> dict[str, str]:
    """The glibc allocator tunables (``MALLOC_*``, ``GLIBC_TUNABLES``) in ``pid``'s environment."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, _, value = item.decode(errors="replace").partition("=")
        if key.startswith("MALLOC_") or key == "GLIBC_TUNABLES":
            out[key] = value
    return out


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (all its threads' ``children`` files)."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(x) for x in (task / "children").read_text().split()]
    return sorted(set(out))


def growth_pct(start: float, end: float) -> float:
    return (end - start) / start * 100.0 if start > 0 else 0.0


def waves_of(total: int, size: int) -> list[int]:
    """Split ``total`` requests into waves of at most ``size`` (the last one smaller)."""
    if total <= 0:
        return []
    size = max(1, size)
    return [size] * (total // size) + ([total % size] if total % size else [])


def worker_stats(client: Any, modality: str = "text") -> dict[str, Any]:
    """The ``fleet_stats`` reply of the ``modality`` worker ({} when it does not answer)."""
    node = f"{modality}@{socket.gethostname()}"
    try:
        replies = client.app.control.broadcast(
            "fleet_stats", reply=True, timeout=5.0, destination=[node], limit=1
        )
    except Exception:
        return {}
    for reply in replies or []:
        for name, stats in reply.items():
            if name.startswith(f"{modality}@") and isinstance(stats, dict):
                return stats
    return {}


# -- the run --------------------------------------------------------------------------------
class Soak:
    """One soak run. :meth:`run` returns the report (a JSON-able dict)."""

    def __init__(self, opts: SoakOptions, log: Callable[[str], None] = print) -> None:
        if opts.requests < 1 or opts.wave < 1 or opts.warmup < 0:
            raise SoakError("requests and wave must be >= 1, warmup >= 0")
        self.opts = opts
        self.log = log
        self.sentences = load_sentences(opts.sentences)
        self._next = 0

    def _texts(self, n: int) -> list[str]:
        out = [self.sentences[(self._next + i) % len(self.sentences)] for i in range(n)]
        self._next += n
        return out

    def run(self) -> dict[str, Any]:
        """Start the stack, warm up, soak, stop the stack; return the report.

        Raises:
            SoakError: the stack did not start or the worker's pid could not be read.
        """
        from producer.stack.local import Stack, StackError

        own_dir = self.opts.run_dir is None
        run_dir = (
            Path(tempfile.mkdtemp(prefix="fleet-soak-")) if own_dir else Path(self.opts.run_dir)  # type: ignore[arg-type]
        )
        ok = False
        try:
            with isolated_environment(run_dir, self.opts.env) as settings:
                stack = Stack(settings)
                self.log(f"soak: starting Redis + text worker (run dir {run_dir})")
                try:
                    stack.up(["text"], flower=False)
                except StackError as exc:
                    raise SoakError(f"stack did not start: {exc}") from None
                try:
                    report = self._soak(stack, settings)
                    ok = True
                    return report
                finally:
                    stack.down()
        finally:
            if own_dir and ok:
                shutil.rmtree(run_dir, ignore_errors=True)
            elif own_dir:
                self.log(f"soak: run dir kept for its logs: {run_dir}")
            else:
                shutil.rmtree(run_dir / "redis", ignore_errors=True)

    def _soak(self, stack: Any, settings: Any) -> dict[str, Any]:
        from producer.client import FleetClient

        worker = _worker_facts(stack)
        pid = worker["pid"]
        client = FleetClient(settings, role="operator")
        started_utc = datetime.now(UTC).isoformat()
        load_start = os.getloadavg()

        # Warmup: the first requests pay one-time costs (allocator arenas, tokenizer caches).
        warm_errors: Counter[str] = Counter()
        t0 = time.monotonic()
        for n in waves_of(self.opts.warmup, self.opts.wave):
            self._wave(client, n, warm_errors)
        warmup_s = time.monotonic() - t0
        stats_start = worker_stats(client)
        rss_start = read_rss_mb(pid)
        self.log(
            f"soak: warmed up with {self.opts.warmup} requests in {warmup_s:.1f} s; "
            f"worker pid {pid} RSS {rss_start:.1f} MiB"
        )
        samples, errors, waves, duration_s = self._measured_waves(client, pid, rss_start)
        stats_end = worker_stats(client)
        client.app.close()

        run_start = stats_start.get("runtime") or {}
        run_end = stats_end.get("runtime") or {}
        n_err = sum(errors.values())
        return {
            "requests": self.opts.requests,
            "succeeded": self.opts.requests - n_err,
            "errors": n_err,
            "error_codes": dict(errors),
            "timeouts": errors.get("TIMEOUT", 0),
            "warmup_requests": self.opts.warmup,
            "warmup_errors": sum(warm_errors.values()),
            "warmup_s": round(warmup_s, 3),
            "wave_size": self.opts.wave,
            "waves": waves,
            "priority": self.opts.priority,
            **_rss_figures(samples, rss_start),
            "cuda_reserved_mb_start": run_start.get("cuda_reserved_mb"),
            "cuda_reserved_mb_end": run_end.get("cuda_reserved_mb"),
            "duration_s": round(duration_s, 3),
            "throughput_rps": round(self.opts.requests / duration_s, 2) if duration_s else None,
            "worker": _worker_section(worker, stats_start, stats_end),
            "machine": {
                "cpus": os.cpu_count(),
                "load_avg_start": [round(x, 2) for x in load_start],
                "load_avg_end": [round(x, 2) for x in os.getloadavg()],
            },
            "started_utc": started_utc,
            "finished_utc": datetime.now(UTC).isoformat(),
        }

    def _measured_waves(
        self, client: Any, pid: int, rss_start: float
    ) -> tuple[list[dict[str, Any]], Counter[str], int, float]:
        """The measured waves, the worker's RSS (MiB) after each; returns the RSS samples,
        the error codes counted, the number of waves and the duration (s)."""
        samples: list[dict[str, Any]] = [
            {"wave": 0, "requests_done": 0, "t_s": 0.0, "rss_mb": round(rss_start, 2)}
        ]
        errors: Counter[str] = Counter()
        done = 0
        t_start = time.monotonic()
        plan = waves_of(self.opts.requests, self.opts.wave)
        for i, n in enumerate(plan, start=1):
            self._wave(client, n, errors)
            done += n
            rss = read_rss_mb(pid)
            t = time.monotonic() - t_start
            samples.append(
                {"wave": i, "requests_done": done, "t_s": round(t, 3), "rss_mb": round(rss, 2)}
            )
            if i == len(plan) or i % max(1, len(plan) // 10) == 0:
                self.log(
                    f"soak: {done}/{self.opts.requests} requests, {done / t:.0f}/s, "
                    f"RSS {rss:.1f} MiB, errors {sum(errors.values())}"
                )
        return samples, errors, len(plan), time.monotonic() - t_start

    def _wave(self, client: Any, n: int, errors: Counter[str]) -> None:
        """Submit ``n`` requests, wait for all, count failures by code; forget the results."""
        from producer.client import SubmitRequest

        reqs = [SubmitRequest("text", {"text": t}, self.opts.priority) for t in self._texts(n)]
        handles = client.submit_many(reqs)
        outcomes = client.wait_all(handles, timeout_s=self.opts.wave_timeout_s)
        for out in outcomes:
            if out is None:
                errors["TIMEOUT"] += 1
            elif "error" in out:
                errors[str(out["error"].get("code", "FLEET_ERROR"))] += 1
            elif not _is_embedding(out.get("result")):
                errors["BAD_RESULT"] += 1
        # Results are read: drop them from Redis so its memory stays flat too.
        backend = client.app.backend
        with contextlib.suppress(Exception):
            backend.client.delete(*[backend.get_key_for_task(h.id) for h in handles])


def _worker_facts(stack: Any) -> dict[str, Any]:
    """The text worker's pid, whether it is a Celery worker, its children, its malloc env.

    Raises:
        SoakError: no pidfile for the worker.
    """
    pid = stack._read_pid(stack.pids / f"{WORKER}.pid")
    if pid is None:
        raise SoakError(f"no pidfile for {WORKER}")
    cmdline = process_cmdline(pid)
    return {
        "pid": pid,
        "cmdline_is_celery_worker": "celery" in " ".join(cmdline) and "worker" in cmdline,
        "child_processes": len(child_pids(pid)),
        "malloc_env": malloc_env(pid),
    }


def _rss_figures(samples: list[dict[str, Any]], rss_start: float) -> dict[str, Any]:
    """RSS (MiB) at the start (as read), the end, its max and growth, from the samples."""
    rss_end = samples[-1]["rss_mb"]
    return {
        "rss_mb_start": round(rss_start, 2),
        "rss_mb_end": round(rss_end, 2),
        "rss_mb_max": round(max(s["rss_mb"] for s in samples), 2),
        "rss_growth_pct": round(growth_pct(rss_start, rss_end), 3),
        "rss_samples": samples,
    }


def _worker_section(
    worker: dict[str, Any], stats_start: dict[str, Any], stats_end: dict[str, Any]
) -> dict[str, Any]:
    """The report's ``worker``: its facts, runtime and the ``fleet_stats`` deltas."""
    run_start = stats_start.get("runtime") or {}
    run_end = stats_end.get("runtime") or {}
    return {
        **worker,
        "device": run_end.get("device") or run_start.get("device"),
        "torch_threads": run_end.get("torch_threads"),
        "arena_overflows": run_end.get("arena_overflows"),
        "succeeded_delta": _delta(stats_start, stats_end, "succeeded"),
        "failed_delta": _delta(stats_start, stats_end, "failed"),
        "batches_delta": _delta(stats_start, stats_end, "batches"),
    }


def _is_embedding(result: Any) -> bool:
    if not isinstance(result, dict):
        return False
    emb = result.get("embedding")
    return isinstance(emb, list) and len(emb) == result.get("dim", len(emb)) and len(emb) > 0


def _delta(a: dict[str, Any], b: dict[str, Any], key: str) -> int | None:
    if key in a and key in b:
        return int(b[key]) - int(a[key])
    return None


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def summary(report: dict[str, Any]) -> str:
    cuda = ""
    if report.get("cuda_reserved_mb_start") is not None:
        cuda = (
            f"; CUDA reserved {report['cuda_reserved_mb_start']:.1f} -> "
            f"{report['cuda_reserved_mb_end']:.1f} MiB"
        )
    return (
        f"soak: {report['requests']} requests in {report['waves']} waves of "
        f"{report['wave_size']}, {report['errors']} errors, {report['duration_s']:.1f} s "
        f"({report['throughput_rps']}/s); worker RSS {report['rss_mb_start']:.1f} -> "
        f"{report['rss_mb_end']:.1f} MiB (max {report['rss_mb_max']:.1f}), growth "
        f"{report['rss_growth_pct']:+.2f}%{cuda}"
    )


def main(opts: SoakOptions) -> int:
    """Run a soak, write and summarise the report; see the module docstring for exit codes."""
    import sys

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        report = Soak(opts, log=log).run()
    except SoakError as exc:
        log(f"soak failed: {exc}")
        return 1
    if opts.out is not None:
        write_report(report, opts.out)
        log(f"soak: report written to {opts.out}")
    print(summary(report))
    return 0 if report["errors"] == 0 else 1
