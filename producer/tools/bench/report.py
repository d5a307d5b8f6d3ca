"""The bench report: one JSON document, a table on stdout, files under ``reports/bench``.

JSON layout (``schema`` 1; milliseconds and requests per second throughout)::

    workload, workload_spec, started_utc, finished_utc, duration_s, repetitions, machine
    modes.{fleet,baseline,celery-batches,ray-serve}.{modality}: throughput_rps (median),
        throughput_spread {min,median,max}, throughput_reps, drain_rps.{priority},
        offered_rps, requests, ok, errors
    modes.limit.{modality}: throughput_rps, throughput_spread, throughput_reps,
        best_batch_size, sweep_rps, unsorted_rps
    modes.redis-limit.{modality}: throughput_rps, throughput_spread, throughput_reps (messages
        pushed and popped per second by raw pipelines, ``producer/tools/bench/redislimit.py``)
    workers.{modality}: worker processes per modality (fleet, baseline, gateway)
    cpu_us_per_request.{mode} (workloads with ``accounting_idle_s``; ``accounting.py``): CPU
        microseconds per request completed in the accounted window (warmup_s to the load's
        end), by role: producer (the bench process: generator, result collector, event tap),
        redis, worker (every worker process tree of the mode; a peer's server), ray:<role>
        (ray-serve's processes by role: raylet, gcs_server, ProxyActor, ServeReplica, ...),
        flower / exporter / gateway when running, total
    redis_cpu_us_per_request.{mode}: Redis CPU (INFO cpu) per request, idle background
        subtracted
    accounting.{mode}: repetitions, window_s, completed, rps, cpu_cores.{role} (cores busy
        over the window), cpu_us_per_request, redis_cpu_us_per_request, redis_bound_rps
        (1 s / redis_cpu_us_per_request: the rate one Redis thread could serve),
        redis_commands_per_request, redis_calls_by_command.{cmd} (every command) and
        redis_usec_by_command.{cmd} (the top 8) per request, background subtracted;
        redis_io_per_request (net_in_bytes, net_out_bytes, socket_reads, socket_writes,
        kernel_share, forked_cpu_us: AOF rewrites, forks, connected_clients, pubsub_clients;
        background not subtracted); idle (the background: seconds, redis_commands_per_s,
        redis_cpu_us_per_s, cpu_us_per_s.{role}); medians over repetitions
    latency_ms.{fleet,baseline}.{modality}.{priority}: p50, p95, p99, max, n, spread
    queue_wait_ms / compute_ms: the same shape (from Celery task events)
    overhead_ms.{mode}.{modality}: median of (end-to-end - compute) per request
    deadline_misses.{mode}.{modality}.{priority}: fraction of requests
    errors.{mode}.{modality}.{code}: count (NO_RESULT: no result within the drain timeout)
    outcomes.{mode}: every request sent, warmup included: sent, ok, errors {code: count}
    batch_sizes.{mode}.{modality}: batches (by size, from fleet_stats), requests (by the
        size of the batch each ran in), model_busy (median over repetitions of the share of a
        repetition's wall time, first send to last result, that the worker's inference
        threads spent running batches; fleet only), model_busy_reps
    ratios.{modality}: fleet_over_baseline, fleet_over_limit (of median throughputs), and
        fleet_over_celery-batches, fleet_over_ray-serve when those peers ran (bench/peers/);
        interleaved runs also by_repetition.fleet_over_{mode}: [repetition k's ratio, ...]
    order (interleaved runs): the modes in the order each repetition ran them
    cold_start.{mode}.{modality}: ready_s, first_ms, warm_idle_ms, idle_overhead_ms,
        steady_p50_ms, worker_warmup_s
    generator.{mode}.{phase}: send lag p50/p99/max, behind
    warnings: what makes numbers of this run doubtful, in words
    metrics_cost (``--metrics-cost`` only; modes are then ``metrics-on`` and ``metrics-off``,
        one repetition per round; ``producer/tools/bench/metricscost.py``): modalities, rounds,
        round_s, order (variants as run), on / off (requests/s per round, summed over the
        modalities), median_on, median_off, cost_pct ((off - on) / off, percent),
        round_cost_pct (each round's pair), round_cost_spread {min,median,max},
        spread_pct.{on,off} ((max - min) / median across rounds), target_pct, within_target
        (cost_pct <= target_pct), resolved (two rounds or more whose round_cost_pct lie
        within target_pct points of each other), sample_ratio, requests.{on,off} (sent,
        warmup included), checks (per round, variant and modality: metrics_enabled, tracing,
        metrics_served, metrics_requests_ok), spans {exported, traces, by_name,
        sampled_share (traces / requests.on)}

The ``transport`` workload has a runner of its own (``producer/tools/bench/transport.py``, no
modes) and writes, besides workload/machine/method/warnings::

    transport.{1MB,16MB,128MB}: shm_ms, shm_fresh_ms, inline_ms (medians), memcpy_ms
        (best), shm_over_memcpy, shm_fresh_over_memcpy, inline_over_shm, message_bytes_shm,
        message_bytes_inline (raw Redis entries), put_ms, probe_read_ms, shm_rest_ms,
        spread_ms, samples_ms, redis_memory (used_memory around each series), errors
    redis: version, proto_max_bulk_len, client_query_buffer_limit, appendonly, used_memory
    done_when: the issue's criteria at the largest size; shm_files_before/after

The ``submit-rate`` workload (``runner = "submit-rate"``, ``producer/tools/bench/submitrate.py``,
no modes; ``repetitions`` are its rounds) writes, besides workload/machine/method/warnings::

    submit_rate: requests (N per path and round), chunk, message_bytes (median),
        message_bytes_range, list_keys, verdict {target_submit_many_over_raw, met}
    submit_rate.paths.{raw,submit_many,submit,submit_many+wait}: rps (median over rounds),
        rps_spread {min,median,max}, cpu_us_per_request (median), rounds (per round: rps, s,
        cpu_us_per_request, and enqueued for the send paths; for submit_many+wait wall_s,
        submit_rps, results, ok, errors {code: count})
    submit_rate.ratios: submit_many_over_raw, submit_over_raw, submit_many+wait_over_raw
    submit_rate.commands_per_request.{path}: Redis commands per request by name
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
from importlib import metadata
from pathlib import Path
from typing import Any

from producer.tools.bench.peers import PEER_MODES
from producer.tools.bench.records import NO_RESULT
from producer.tools.bench.runner import BenchResult, ModeResult, summarize_mode
from producer.tools.bench.stats import spread
from producer.tools.bench.workload import Workload

SCHEMA_VERSION = 1
NOISY_SPREAD = 0.10  # (max - min) / median of throughput above this: say it is noisy
_PACKAGES = ("torch", "transformers", "celery", "kombu", "redis", "pydantic", "numpy")


def report_head(w: Workload, started: str, duration_s: float) -> dict[str, Any]:
    """The keys every bench report starts with: the schema, the workload (name, description,
    spec), when it started and finished (UTC, ISO 8601) and how long it ran."""
    from datetime import UTC, datetime

    return {
        "schema": SCHEMA_VERSION,
        "workload": w.name,
        "description": w.description,
        "workload_spec": w.model_dump(mode="json"),
        "started_utc": started,
        "finished_utc": datetime.now(UTC).isoformat(),
        "duration_s": round(duration_s, 1),
    }


def machine_info(res: BenchResult) -> dict[str, Any]:
    """Cores, CPU, memory, device and torch threads per modality, versions, load."""
    versions = {"python": platform.python_version()}
    for pkg in _PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    versions["redis_server"] = res.redis_version or None
    workers: dict[str, Any] = {}
    for m, facts in res.settings_facts.items():
        runtime = next(
            (mr.workers.get(m, {}).get("runtime") for mr in res.modes.values()
             if mr.workers.get(m, {}).get("runtime")),
            None,
        )  # fmt: skip
        model = next(
            (mr.workers[m].get("model") for mr in res.modes.values()
             if mr.workers.get(m, {}).get("model")),
            None,
        )  # fmt: skip
        workers[m] = {
            **facts,
            "device": (runtime or {}).get("device", facts["device"]),
            "torch_threads": (runtime or {}).get("torch_threads", facts["torch_threads"]),
            "model_facts": model,
        }
    return {
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "memory_gb": _memory_gb(),
        "platform": platform.platform(),
        "workers": workers,
        "torch_threads": {m: w["torch_threads"] for m, w in workers.items()},
        "device": {m: w["device"] for m, w in workers.items()},
        "versions": versions,
        "load_avg_start": list(res.load_avg_start),
        "load_avg_end": list(res.load_avg_end),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _offered_rps(mr: ModeResult, modality: str, w: Any) -> float | None:
    """Measured requests of ``modality`` per second of their scheduled span (median).

    ``None`` unless every phase that sends ``modality`` is ``poisson``: a burst's or a
    closed loop's send rate says nothing about the load offered over time.
    """
    phases = [p for p in w.phases if any(w.sources[m.source].modality == modality
                                         for m in p.mix)]  # fmt: skip
    if not phases or any(p.arrival != "poisson" for p in phases):
        return None
    vals = []
    for recs in mr.reps:
        rs = [r for r in recs if r.measured and r.modality == modality]
        if len(rs) < 2:
            continue
        span = (max(r.sched_ms for r in rs) - min(r.sched_ms for r in rs)) / 1000.0
        if span > 0:
            vals.append(len(rs) / span)
    sp = spread(vals)
    return None if sp is None else sp["median"]


METHOD = {
    "latency_from": "scheduled send time (producer monotonic clock, one wall offset)",
    "done_at": "worker's date_done of the stored result",
    "percentiles": "per repetition, linear interpolation; median across repetitions",
    "baseline_priority": "every baseline message at one Celery priority (FIFO)",
    "limit": "same adapter in-process, inputs sorted by length, best batch size",
}
# The report's sections keyed by mode then modality, in the order they are written.
PER_MODE_KEYS = ("latency_ms", "latency_all_ms", "queue_wait_ms", "compute_ms", "overhead_ms",
                 "deadline_misses", "deadlines", "errors", "requests", "batch_sizes",
                 "cold_start", "generator", "outcomes")  # fmt: skip


def build_report(res: BenchResult) -> dict[str, Any]:
    """The whole JSON report of a run (see the module docstring)."""
    w = res.workload
    rep: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "workload": w.name,
        "description": w.description,
        "workload_spec": w.model_dump(mode="json"),
        "started_utc": res.started_utc,
        "finished_utc": res.finished_utc,
        "duration_s": round(res.duration_s, 1),
        "repetitions": res.repetitions,
        "machine": machine_info(res),
        "run_dir": res.run_dir,
        "method": {**METHOD, "order": "interleaved" if res.order else "sequential"},
    }
    if res.order:
        rep["order"] = res.order
    modes: dict[str, Any] = {}
    for key in PER_MODE_KEYS:
        rep[key] = {}
    for mode, mr in res.modes.items():
        summary = summarize_mode(mr, w)
        modes[mode] = {}
        for m, s in summary["modalities"].items():
            modes[mode][m] = _mode_entry(mr, m, s, w)
            _add_modality(rep, mode, m, s, mr)
        rep["generator"][mode] = summary["lag"]
        rep["outcomes"][mode] = _outcomes(mr)
    if res.limit:
        modes["limit"] = _limit_entries(res.limit)
    if res.redis_limit:
        modes["redis-limit"] = _limit_entries(res.redis_limit)
    rep["modes"] = modes
    if res.workers:
        rep["workers"] = res.workers
    if res.accounting:
        rep.update(accounting_sections(res.accounting))
    rep["cdf_ms"] = {mode: _cdf_samples(mr) for mode, mr in res.modes.items()}
    rep["ratios"] = _ratios(modes, paired=bool(res.order))
    if "gateway" in res.modes:  # bench/gateway.py: the fleet through `fleet gateway`
        rep["gateway"] = _gateway_section(res, modes)
    rep["noise"] = _noise(modes)
    if res.metrics_cost:
        rep["metrics_cost"] = res.metrics_cost
    rep["warnings"] = _warnings(res, rep)
    return rep


def _mode_entry(mr: ModeResult, m: str, s: dict[str, Any], w: Workload) -> dict[str, Any]:
    """``modes.<mode>.<modality>``: throughput (req/s, its spread) and request counts."""
    return {
        "throughput_rps": s["throughput_rps"],
        "throughput_spread": s["throughput_spread"],
        "throughput_reps": s["throughput_reps"],
        "drain_rps": s["drain_rps"],
        "offered_rps": _offered_rps(mr, m, w),
        "requests": s["requests"],
        "ok": s["ok"],
        "errors": sum(s["errors"].values()),
    }


def _add_modality(
    rep: dict[str, Any], mode: str, m: str, s: dict[str, Any], mr: ModeResult
) -> None:
    """Write one modality's summary ``s`` under ``rep[<section>][mode][m]``."""

    def put(key: str, value: Any) -> None:
        rep[key].setdefault(mode, {})[m] = value

    for key in ("latency_ms", "latency_all_ms", "queue_wait_ms", "compute_ms", "overhead_ms"):
        put(key, s[key])
    put("deadline_misses", {p: d["fraction"] for p, d in s["deadline"].items()})
    put("deadlines", s["deadline"])
    put("errors", s["errors"])
    put(
        "requests",
        {
            "measured": s["requests"],
            "ok": s["ok"],
            "errors": sum(s["errors"].values()),
            "no_result": s["errors"].get(NO_RESULT, 0),
            "events_seen": s["events_seen"],
        },
    )
    put("batch_sizes", _batch_sizes(mode, m, s, mr))
    cold = dict(mr.cold.get(m, {}))
    cold["steady_p50_ms"] = s["latency_all_ms"]["p50"]
    runtime = mr.workers.get(m, {}).get("runtime") or {}
    cold["worker_warmup_s"] = runtime.get("warmup_s")
    put("cold_start", cold)


def _batch_sizes(mode: str, m: str, s: dict[str, Any], mr: ModeResult) -> dict[str, Any]:
    """Batches by size, requests by the size of the batch they ran in, triggers, busy share."""
    batches = {str(k): v for k, v in sorted(mr.batches.get(m, {}).items()) if v}
    if mode == "baseline":  # one task per message, by construction
        batches = {"1": s["ok"]}
        req_sizes = {"1": s["ok"]}
    else:
        req_sizes = s["request_batch_sizes"]
    return {
        "batches": batches,
        "requests": req_sizes,
        "triggers": dict(mr.triggers.get(m, {})),
        "model_busy": _median_or_none(mr.model_busy.get(m)),
        "model_busy_reps": mr.model_busy.get(m, []),
    }


def _limit_entries(limit: dict[str, Any]) -> dict[str, Any]:
    """``modes.limit``: the in-process limit per modality, with its median throughput."""
    out: dict[str, Any] = {}
    for m, lim in limit.items():
        sp = spread(lim["throughput_reps"])
        out[m] = {
            "throughput_rps": None if sp is None else sp["median"],
            "throughput_spread": sp,
            **lim,
        }
    return out


def _gateway_section(res: BenchResult, modes: dict[str, Any]) -> dict[str, Any]:
    """The gateway's idle overhead and its throughput over the direct fleet's."""
    gw = modes.get("gateway", {})
    return {
        "idle_overhead": res.modes["gateway"].gateway,
        "throughput_over_direct": {
            m: _ratio(gw[m]["throughput_rps"], modes.get("fleet", {}).get(m, {}).get(
                "throughput_rps"))
            for m in gw
        },
    }  # fmt: skip


def _outcomes(mr: ModeResult) -> dict[str, Any]:
    """Every request of every repetition (warmup included): results and coded errors."""
    recs = [r for reps in mr.reps for r in reps]
    codes: dict[str, int] = {}
    for r in recs:
        if not r.ok:
            key = r.code or "UNKNOWN"
            codes[key] = codes.get(key, 0) + 1
    return {"sent": len(recs), "ok": sum(bool(r.ok) for r in recs), "errors": codes}


def _cdf_samples(mr: ModeResult, points: int = 1000) -> dict[str, dict[str, dict[str, Any]]]:
    """Per modality and priority, pooled over repetitions: the successful measured latencies
    (sorted, thinned to ``points`` evenly spaced order statistics) and how many measured
    requests there were, so a CDF drawn over all requests stops below 1 by the failures."""
    groups: dict[str, dict[str, dict[str, Any]]] = {}
    for recs in mr.reps:
        for r in recs:
            if not r.measured:
                continue
            g = groups.setdefault(r.modality, {}).setdefault(
                r.priority, {"values": [], "requests": 0}
            )
            g["requests"] += 1
            if r.ok and r.e2e_ms is not None:
                g["values"].append(r.e2e_ms)
    for prios in groups.values():
        for g in prios.values():
            xs = sorted(g["values"])
            if len(xs) > points:
                step = (len(xs) - 1) / (points - 1)
                xs = [xs[round(i * step)] for i in range(points)]
            g["ok"] = len(g["values"])
            g["values"] = [round(x, 2) for x in xs]
    return groups


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _ratios(modes: dict[str, Any], paired: bool = False) -> dict[str, Any]:
    """Fleet over each other mode, of median throughputs; ``paired`` (an interleaved run):
    also ``by_repetition``, repetition k's ratio, both measured in the same round."""
    out: dict[str, Any] = {}
    fleet = modes.get("fleet", {})
    for m in fleet:
        f = fleet[m]["throughput_rps"]
        out[m] = {
            "fleet_over_baseline": _ratio(f, modes.get("baseline", {}).get(m, {}).get(
                "throughput_rps")),
            "fleet_over_limit": _ratio(f, modes.get("limit", {}).get(m, {}).get(
                "throughput_rps")),
            **{f"fleet_over_{p}": _ratio(f, modes[p][m]["throughput_rps"])
               for p in (*PEER_MODES, "redis-limit") if m in modes.get(p, {})},
        }  # fmt: skip
        if paired:
            out[m]["by_repetition"] = _paired(modes, m)
    return out


def _paired(modes: dict[str, Any], m: str) -> dict[str, list[float | None]]:
    """``fleet_over_<mode>`` per repetition, for every other mode with ``m``'s throughputs."""
    fleet = modes["fleet"][m].get("throughput_reps") or []
    out: dict[str, list[float | None]] = {}
    for mode, mods in modes.items():
        other = mods.get(m, {}).get("throughput_reps") if mode != "fleet" else None
        if other:
            out[f"fleet_over_{mode}"] = [_ratio(a, b) for a, b in zip(fleet, other, strict=False)]
    return out


def _noise(modes: dict[str, Any]) -> dict[str, Any]:
    """Relative throughput spread, (max - min) / median, per mode and modality."""
    out: dict[str, Any] = {}
    for mode, mods in modes.items():
        for m, s in mods.items():
            sp = s.get("throughput_spread")
            if sp and sp["median"]:
                out.setdefault(mode, {})[m] = (sp["max"] - sp["min"]) / sp["median"]
    return out


def _warnings(res: BenchResult, rep: dict[str, Any]) -> list[str]:
    out = list(res.notes)
    cores = os.cpu_count() or 1
    if res.load_avg_start and res.load_avg_start[0] > 0.5 * cores:
        out.append(
            f"the machine was busy before the run (load average {res.load_avg_start[0]:.2f} on "
            f"{cores} cores): other processes competed with the bench"
        )
    if res.repetitions < 3:
        out.append(f"only {res.repetitions} repetition(s): the spread says little")
    for mode, phases in rep["generator"].items():
        for name, ph in phases.items():
            if ph["behind"]:
                out.append(
                    f"{mode}: the generator fell behind its schedule in phase {name!r} "
                    f"(send lag p99 {ph['p99_ms']:.1f} ms, max {ph['max_ms']:.1f} ms); "
                    "latencies still count from the scheduled times"
                )
    for mode, mods in rep["requests"].items():
        for m, r in mods.items():
            if r["no_result"]:
                out.append(f"{mode}/{m}: {r['no_result']} request(s) got no result in time")
            # Peers send no per-request task events: queue/compute are the fleet's only.
            if r["ok"] and r["events_seen"] < 0.95 * r["ok"] and mode not in PEER_MODES:
                out.append(
                    f"{mode}/{m}: task events seen for {r['events_seen']}/{r['ok']} requests; "
                    "queue wait and compute cover only those"
                )
    for mode, mr in res.modes.items():
        if mr.leftovers:
            out.append(f"{mode}: {mr.leftovers} message(s) were left queued after repetitions")
    for mode, mods in rep["noise"].items():
        for m, rel in mods.items():
            if rel > NOISY_SPREAD:
                out.append(f"{mode}/{m}: throughput varied {rel:.0%} across repetitions")
    for mode, mods in rep["modes"].items():
        for m, s in mods.items():
            offered, got = s.get("offered_rps"), s.get("throughput_rps")
            if offered and got and got >= 0.95 * offered and mode == "fleet":
                out.append(
                    f"fleet/{m}: throughput ({got:.1f}/s) is the offered load ({offered:.1f}/s): "
                    "not saturated, so throughput ratios describe the load, not capacity"
                )
    if res.limit_error:
        out.append(res.limit_error)
    if res.redis_limit_error:
        out.append(res.redis_limit_error)
    for mode, acc in rep.get("accounting", {}).items():
        busy = (acc.get("cpu_cores") or {}).get("producer")
        if busy is not None and busy >= PRODUCER_BUSY_CORES:
            out.append(
                f"{mode}: the bench process used {busy:.2f} cores in the accounted window: "
                "the generator (one Python process) may be what limits the rate"
            )
    return out


PRODUCER_BUSY_CORES = 0.85  # a Python process near one core is bound by its GIL


def accounting_sections(acc: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """``cpu_us_per_request``, ``redis_cpu_us_per_request`` and ``accounting`` (the detail)
    from each mode's windows and idle backgrounds (``BenchResult.accounting``)."""
    from producer.tools.bench.accounting import combine_windows

    cpu, redis_cpu, detail = {}, {}, {}
    for mode, parts in acc.items():
        combined = combine_windows(parts.get("windows", []))
        if not combined:
            continue
        idles = parts.get("idle", [])
        combined["idle"] = {
            "windows": len(idles),
            "s": _rounded([i["s"] for i in idles], 2),
            "redis_commands_per_s": _rounded([sum(i["calls_per_s"].values()) for i in idles], 1),
            "redis_cpu_us_per_s": _rounded([i["redis_cpu_s_per_s"] * 1e6 for i in idles], 0),
            "cpu_us_per_s": {
                role: _rounded([i["cpu_us_per_s"].get(role, 0.0) for i in idles], 0)
                for role in sorted({r for i in idles for r in i["cpu_us_per_s"]})
            },
        }
        cpu[mode] = combined["cpu_us_per_request"]
        redis_cpu[mode] = combined["redis_cpu_us_per_request"]
        detail[mode] = combined
    return {"cpu_us_per_request": cpu, "redis_cpu_us_per_request": redis_cpu, "accounting": detail}


# -- files ------------------------------------------------------------------------------------
def run_reported(run: Any, print_report: Any, out_dir: Path, err: Any, plot: bool = False) -> int:
    """Run a bench of its own kind (``run()`` returns its report), write its files and print
    it with ``print_report(report, console)``; exit status 1 if it failed (``BenchError``)."""
    import sys

    from rich.console import Console

    from producer.tools.bench.results import BenchError

    try:
        report = run()
    except BenchError as exc:
        err.print(f"[red]bench failed:[/red] {exc}")
        return 1
    write_report(report, out_dir, plot=plot)
    print_report(report, Console(file=sys.stdout, width=150))
    return 0


def write_report(report: dict[str, Any], out_dir: Path, plot: bool = True) -> dict[str, str]:
    """Write ``<workload>-<UTC stamp>.json`` and ``latest.json`` (and the plot, ``.png``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = report["started_utc"][:19].replace("-", "").replace(":", "") + "Z"
    base = out_dir / f"{report['workload']}-{stamp}"
    files = {"json": str(base.with_suffix(".json")), "latest": str(out_dir / "latest.json")}
    if plot:
        from producer.tools.bench.plot import plot_report

        try:
            plot_report(report, base.with_suffix(".png"))
            shutil.copyfile(base.with_suffix(".png"), out_dir / "latest.png")
            files["plot"] = str(base.with_suffix(".png"))
        except Exception as exc:  # a plot must never lose the numbers
            report.setdefault("warnings", []).append(f"plot failed: {exc}")
    report["files"] = files
    text = json.dumps(report, indent=2, default=_json_default)
    Path(files["json"]).write_text(text)
    Path(files["latest"]).write_text(text)
    return files


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, set | tuple):
        return list(obj)
    raise TypeError(f"not JSON-serializable: {type(obj).__name__}")


# -- table ------------------------------------------------------------------------------------
def _rounded(xs: list[float], digits: int) -> float | None:
    m = _median_or_none(xs)
    return None if m is None else round(m, digits)


def _median_or_none(xs: list[float] | None) -> float | None:
    return statistics.median(xs) if xs else None
