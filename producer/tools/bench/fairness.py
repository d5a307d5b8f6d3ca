"""``fleet bench tenant-fairness``: tenants' weighted fair share against FIFO, in one sitting.

``configs/workloads/tenant-fairness.toml`` gives the load: its phases each name a
``tenant`` (tenant A floods BULK texts at t=0, tenant B sends a few BULK texts a moment
later) and a REALTIME stream of no tenant runs meanwhile. The stack is the bench's own (a
Redis on free ports, one text worker in batch mode, ``.run/bench/tenant-fairness-<time>``).

Per repetition (``repetitions``, ``--repetitions``) both modes run, ``fifo`` and ``fair``
(``[tenancy] share``, for the worker and the producer alike; Redis flushed and a fresh worker
between them), in rotating order (``fifo, fair``, then ``fair, fifo``, ...: a drift of the
machine falls on both). Per mode:

1. the worker starts and answers a few warm-up requests;
2. the schedule is sent by one thread (each burst one ``submit_many``, the stream one
   request at a time at its times), every request's send time taken (wall clock);
3. every result is awaited; a request's latency is its result's ``date_done`` (the worker's
   wall clock, same machine) less its send time.

Per mode the report gives each tenant's (and REALTIME's) latency percentiles, A's
throughput (A's requests over the span from A's first send to A's last result), and from
the worker's log line per request (``request id=... queued_ms=... batch=... total_ms=...``
with the record's time): when each request entered the window and when its batch started,
hence for each of B's requests how many batches started while it was in the window, and how
many of them held A's requests and none of B's (``b_waited_behind_a_batches``: its max).
``fairness`` holds the figures the issue names: ``b_p99_ms``, ``a_throughput_rps`` (each
``{fair, fifo}``: medians over the repetitions; each repetition's in ``by_repetition``),
their ratios (each repetition's own pair, and the worst of them), the max batches over all
repetitions, and whether every REALTIME request beat every BULK request of its mode.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from statistics import median
from typing import Any

from rich.console import Console
from rich.table import Table

from producer.client import FleetClient, SubmitRequest
from producer.tools.bench.results import BenchError
from producer.tools.bench.schedule import Planned, open_schedule
from producer.tools.bench.sources import InputCatalog
from producer.tools.bench.stats import percentile
from producer.tools.bench.workload import REPO, Workload
from shared.redis_client import redis_client
from shared.settings import Settings, load_settings

MODES = ("fifo", "fair")  # [tenancy] share; fifo first: the baseline
WARM_REQUESTS = 20

_LINE = re.compile(
    r"request id=(?P<id>\S+) state=\S+ .*?queued_ms=(?P<queued>[\d.]+) .*?"
    r"batch=(?P<batch>\S+) .*?total_ms=(?P<total>[\d.]+)"
)
_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}):")


def window_times(log_text: str, ids: set[str]) -> dict[str, tuple[float, float, str]]:
    """Task id -> (window arrival, batch start, batch id), wall-clock seconds, from the
    worker's log: each record's time (its first line's prefix; the lines of a settled group
    share one record) is when its requests settled, ``total_ms`` how long each was held then,
    ``queued_ms`` how long it waited for its batch."""
    out: dict[str, tuple[float, float, str]] = {}
    stamp = 0.0
    for line in log_text.splitlines():
        found = _STAMP.match(line)
        if found:
            stamp = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        m = _LINE.search(line)
        if m is None or m.group("id") not in ids or m.group("batch") == "-":
            continue
        arrival = stamp - float(m.group("total")) / 1000.0
        out[m.group("id")] = (arrival, arrival + float(m.group("queued")) / 1000.0, m["batch"])
    return out


def batches_behind(
    times: dict[str, tuple[float, float, str]], tenant_of: dict[str, str], waiter: str, other: str
) -> tuple[int, int]:
    """For ``waiter``'s requests: the most batches that started while one of them was in the
    window, and the most of those that held ``other``'s requests and none of ``waiter``'s."""
    starts: dict[str, float] = {}
    members: dict[str, set[str]] = {}
    for tid, (_, start, batch) in times.items():
        starts[batch] = min(start, starts.get(batch, start))
        members.setdefault(batch, set()).add(tenant_of.get(tid, ""))
    most_any = most_other = 0
    for tid, (arrival, start, batch) in times.items():
        if tenant_of.get(tid) != waiter:
            continue
        during = [b for b, s in starts.items() if arrival < s < start and b != batch]
        most_any = max(most_any, len(during))
        alone = [b for b in during if other in members[b] and waiter not in members[b]]
        most_other = max(most_other, len(alone))
    return most_any, most_other


class FairnessBench:
    """Runs the tenant-fairness workload; :meth:`run` returns the report."""

    def __init__(
        self,
        workload: Workload,
        run_dir: Path | None = None,
        console: Console | None = None,
        repetitions: int = 0,
    ) -> None:
        self.w = workload
        self.reps = repetitions or workload.repetitions
        self.run_dir = run_dir
        self.console = console or Console(stderr=True)
        names = {m.source for p in workload.phases for m in p.mix}
        self.catalog = InputCatalog(workload.sources, names)
        self.plan = open_schedule(workload, {s: self.catalog.modality(s) for s in names})
        self.tenant_of_phase = {p.name: p.tenant for p in workload.phases}
        tenants = [t for t in self.tenant_of_phase.values() if t]
        if len(set(tenants)) < 2:
            raise BenchError("the tenant-fairness workload needs phases of two tenants")
        self.flooder, self.late = tenants[0], next(t for t in tenants if t != tenants[0])

    def run(self) -> dict[str, Any]:
        """Start Redis, run both modes, stop.

        Raises:
            BenchError: Redis or the worker did not start, or results were missing.
        """
        from producer.tools.bench.runner import bench_stack

        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        run_dir = self.run_dir or (REPO / ".run" / "bench" / f"{self.w.name}-{stamp}")
        started = datetime.now(UTC).isoformat()
        t_start = time.monotonic()
        reps: list[dict[str, Any]] = []
        with bench_stack(self.w, run_dir, self._step) as (settings, stack):
            for rep in range(self.reps):
                order = MODES if rep % 2 == 0 else MODES[::-1]
                reps.append({mode: self._mode(stack, settings, mode) for mode in order})
        return self._report(reps, started, run_dir, time.monotonic() - t_start)

    @contextlib.contextmanager
    def _step(self, what: str) -> Iterator[None]:
        with self.console.status(what):
            yield

    def _mode(self, stack: Any, settings: Settings, mode: str) -> dict[str, Any]:
        env = {"FLEET_TENANCY__SHARE": mode}
        admin = redis_client(settings)
        admin.flushdb()
        with self._step(f"{mode}: starting the text worker"):
            stack.start_worker("text", "batch", extra_env=env)
        client = FleetClient(load_settings(tenancy={"share": mode}))
        try:
            for i in range(WARM_REQUESTS):
                client.submit("text", {"text": f"warm up {i}"}).get(timeout_s=120)
            with self._step(f"{mode}: {len(self.plan)} requests"):
                sent = self._send(client)
                handles = [h for h, _, _ in sent]
                outs = client.wait_all(handles, timeout_s=self.w.drain_timeout_s, interval_s=0.2)
        finally:
            client.close()
            stack.stop("worker-text", timeout_s=10)
        missing = sum(o is None for o in outs)
        if missing:
            raise BenchError(f"{mode}: {missing} of {len(outs)} results missing")
        log_text = (stack.logs / "worker-text.log").read_text(errors="replace")
        return self._summarize(mode, sent, outs, log_text)

    def _send(self, client: FleetClient) -> list[tuple[Any, float, Planned]]:
        """Send the schedule (one thread); each request's handle, send time (wall s), plan."""
        sent: list[tuple[Any, float, Planned]] = []
        groups: list[list[Planned]] = []
        for p in self.plan:
            if groups and groups[-1][0].offset_s == p.offset_s and groups[-1][0].phase == p.phase:
                groups[-1].append(p)
            else:
                groups.append([p])
        t0 = time.monotonic()
        lock = threading.Lock()
        for group in groups:
            delay = t0 + group[0].offset_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            reqs = [
                SubmitRequest(
                    p.modality,
                    self.catalog.get(p.source, p.input_index),
                    p.priority,
                    p.timeout_s,
                    tenant=self.tenant_of_phase[p.phase],
                )
                for p in group
            ]
            at = time.time()
            handles = client.submit_many(reqs)
            with lock:
                sent += [(h, at, p) for h, p in zip(handles, group, strict=True)]
        return sent

    def _summarize(
        self, mode: str, sent: list[tuple[Any, float, Planned]], outs: list[Any], log_text: str
    ) -> dict[str, Any]:
        latency: dict[str, list[float]] = {}
        tenant_of: dict[str, str] = {}
        errors: dict[str, int] = {}
        a_first, a_last, a_n = float("inf"), 0.0, 0
        for (h, at, p), o in zip(sent, outs, strict=True):
            who = self.tenant_of_phase[p.phase] or p.priority
            tenant_of[h.id] = who
            if "error" in o:
                errors[o["error"]["code"]] = errors.get(o["error"]["code"], 0) + 1
                continue
            done_s = (o.get("done_ms") or 0.0) / 1000.0
            latency.setdefault(who, []).append((done_s - at) * 1000.0)
            if who == self.flooder:
                a_first, a_last, a_n = min(a_first, at), max(a_last, done_s), a_n + 1
        times = window_times(log_text, set(tenant_of))
        most_any, most_a = batches_behind(times, tenant_of, self.late, self.flooder)
        summary: dict[str, Any] = {
            who: {
                "n": len(v),
                "p50_ms": round(percentile(v, 50), 1),
                "p99_ms": round(percentile(v, 99), 1),
                "max_ms": round(max(v), 1),
                "min_ms": round(min(v), 1),
            }
            for who, v in latency.items()
        }
        bulk_min = min(
            (min(v) for who, v in latency.items() if who in (self.flooder, self.late)),
            default=0.0,
        )
        realtime = latency.get("realtime", [])
        return {
            "latency": summary,
            "a_throughput_rps": round(a_n / (a_last - a_first), 1) if a_n else 0.0,
            "b_waited_batches_max": most_any,
            "b_waited_behind_a_batches_max": most_a,
            "window_records": len(times),
            "realtime_beats_every_bulk": bool(realtime) and max(realtime) < bulk_min,
            "errors": errors,
        }

    def _report(
        self, reps: list[dict[str, Any]], started: str, run_dir: Path, duration_s: float
    ) -> dict[str, Any]:
        from producer.tools.bench.report import report_head

        a, b = self.flooder, self.late
        by_rep = [
            {
                "b_p99_ms": {m: r[m]["latency"][b]["p99_ms"] for m in MODES},
                "a_throughput_rps": {m: r[m]["a_throughput_rps"] for m in MODES},
                "b_p99_fair_over_fifo": round(
                    r["fair"]["latency"][b]["p99_ms"] / r["fifo"]["latency"][b]["p99_ms"], 3
                ),
                "a_throughput_fair_over_fifo": round(
                    r["fair"]["a_throughput_rps"] / r["fifo"]["a_throughput_rps"], 3
                ),
            }
            for r in reps
        ]
        fairness: dict[str, Any] = {
            "tenants": {"a": a, "b": b},
            "repetitions": len(reps),
            "b_p99_ms": {m: median(x["b_p99_ms"][m] for x in by_rep) for m in MODES},
            "a_throughput_rps": {
                m: median(x["a_throughput_rps"][m] for x in by_rep) for m in MODES
            },
            "b_p99_fair_over_fifo": median(x["b_p99_fair_over_fifo"] for x in by_rep),
            "a_throughput_fair_over_fifo": median(x["a_throughput_fair_over_fifo"] for x in by_rep),
            "worst": {
                "b_p99_fair_over_fifo": max(x["b_p99_fair_over_fifo"] for x in by_rep),
                "a_throughput_fair_over_fifo": min(
                    x["a_throughput_fair_over_fifo"] for x in by_rep
                ),
            },
            "b_waited_behind_a_batches_max": {
                m: max(r[m]["b_waited_behind_a_batches_max"] for r in reps) for m in MODES
            },
            "realtime_beats_every_bulk": {
                m: all(r[m]["realtime_beats_every_bulk"] for r in reps) for m in MODES
            },
            "by_repetition": by_rep,
        }
        worst = fairness["worst"]
        fairness["done"] = (
            worst["b_p99_fair_over_fifo"] <= 0.25
            and worst["a_throughput_fair_over_fifo"] >= 0.9
            and fairness["b_waited_behind_a_batches_max"]["fair"] <= 2
            and fairness["realtime_beats_every_bulk"]["fair"]
        )
        return {
            **report_head(self.w, started, duration_s),
            "run_dir": str(run_dir),
            "load_avg_end": os.getloadavg(),
            "repetitions": reps,
            "fairness": fairness,
        }


def print_fairness_report(report: dict[str, Any], console: Console) -> None:
    """The figures as a table (stdout)."""
    f = report["fairness"]
    table = Table(title=f"{report['workload']}: fair share vs FIFO")
    for col in ("", "fifo", "fair", "fair/fifo"):
        table.add_column(col)
    table.add_row(
        f"{f['tenants']['b']} p99 ms",
        str(f["b_p99_ms"]["fifo"]),
        str(f["b_p99_ms"]["fair"]),
        str(f["b_p99_fair_over_fifo"]),
    )
    table.add_row(
        f"{f['tenants']['a']} throughput rps",
        str(f["a_throughput_rps"]["fifo"]),
        str(f["a_throughput_rps"]["fair"]),
        str(f["a_throughput_fair_over_fifo"]),
    )
    behind = f["b_waited_behind_a_batches_max"]
    table.add_row("B behind A-only batches, max", str(behind["fifo"]), str(behind["fair"]), "")
    rt = f["realtime_beats_every_bulk"]
    table.add_row("REALTIME beats every BULK", str(rt["fifo"]), str(rt["fair"]), "")
    console.print(table)
    worst = f["worst"]
    console.print(
        f"medians of {f['repetitions']} repetition(s); worst pair: B p99 fair/fifo "
        f"{worst['b_p99_fair_over_fifo']}, A throughput fair/fifo "
        f"{worst['a_throughput_fair_over_fifo']}; done-when met (worst pair): {f['done']}"
    )


def run_fairness(
    w: Workload, out_dir: Path, run_dir: Path | None, err: Console, repetitions: int = 0
) -> int:
    """``fleet bench tenant-fairness``: run, write ``reports/bench`` files, print; exit status."""
    from producer.tools.bench.report import run_reported

    try:
        bench = FairnessBench(w, run_dir, console=err, repetitions=repetitions)
    except BenchError as exc:
        err.print(f"[red]bench:[/red] {exc}")
        return 1
    return run_reported(bench.run, print_fairness_report, out_dir, err)
