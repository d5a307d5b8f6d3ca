"""The bench report as tables on stdout (the JSON's layout: :mod:`producer.tools.bench.report`)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from producer.tools.bench.peers import PEER_MODES
from producer.tools.bench.peers.report import print_peers


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _range(sp: dict[str, float] | None) -> str:
    return "" if not sp else f" ({sp['min']:.1f}-{sp['max']:.1f})"


def print_report(report: dict[str, Any], console: Console | None = None) -> None:
    """The report as tables on stdout."""
    con = console or Console(width=140)
    n = report["repetitions"]
    con.print(
        f"[bold]bench {report['workload']}[/bold]: {n} repetitions, "
        f"{report['machine']['cores']} cores, {report['duration_s']} s"
    )
    if "metrics_cost" in report:  # --metrics-cost: no fleet/baseline/limit to compare
        from producer.tools.bench.metricscost import print_cost

        print_cost(report, con)
    else:
        _throughput(report, con)
    print_peers(report, con)
    if "gateway" in report:
        _print_gateway(report, con)
    con.print(_latency_table(report))
    con.print(_cold_table(report))
    if report.get("accounting"):
        con.print(cost_table(report))
        _print_commands(report, con)
    _print_notes(report, con)


MAIN_ROLES = ("producer", "redis", "worker")


def cost_table(report: dict[str, Any]) -> Table:
    """Per mode: the accounted window's rate, latency, CPU per request by process role and
    Redis's own figures (``accounting``; roles beyond the main ones summed as ``other``)."""
    t = Table(title="Cost per request in the accounted window: CPU us by process (median "
              "over repetitions); Redis from INFO, idle background subtracted")  # fmt: skip
    for col in ("mode", "req/s", "p50 ms", "p99 ms", *MAIN_ROLES, "other", "total",
                "redis INFO us", "redis cmds", "producer cores"):  # fmt: skip
        t.add_column(col, justify="left" if col == "mode" else "right")
    for mode, acc in report["accounting"].items():
        us = acc.get("cpu_us_per_request") or {}
        other = [v for k, v in us.items() if _other(k) and v is not None]
        lat = [
            v for v in (report.get("latency_all_ms", {}).get(mode) or {}).values() if v
        ]  # one modality in the overhead workloads: its figures; several: the first
        p50 = lat[0].get("p50") if lat else None
        p99 = lat[0].get("p99") if lat else None
        t.add_row(mode, _f(acc.get("rps")), _f(p50, ".2f"), _f(p99, ".2f"),
                  *(_f(us.get(r)) for r in MAIN_ROLES), _f(sum(other) if other else None),
                  _f(us.get("total")), _f(acc.get("redis_cpu_us_per_request")),
                  _f(acc.get("redis_commands_per_request"), ".2f"),
                  _f((acc.get("cpu_cores") or {}).get("producer"), ".2f"))  # fmt: skip
    return t


def _other(role: str) -> bool:
    """A role of the ``other`` column (Ray's roles are summed as ``worker`` already)."""
    return role not in (*MAIN_ROLES, "total") and not role.startswith("ray:")


def _print_commands(report: dict[str, Any], con: Console) -> None:
    """Per mode: the roles in ``other`` and the top Redis commands by usec per request."""
    for mode, acc in report["accounting"].items():
        us = acc.get("cpu_us_per_request") or {}
        top = list((acc.get("redis_usec_by_command") or {}).items())[:5]
        calls = acc.get("redis_calls_by_command") or {}
        line = ", ".join(f"{k} {v:.2f} us ({calls.get(k, 0):.3f} calls)" for k, v in top)
        con.print(f"{mode}: Redis top commands per request by usec: {line or '-'}")
        split = {k: v for k, v in us.items() if (_other(k) or k.startswith("ray:")) and v}
        if split:
            con.print(f"{mode}: CPU us per request beyond producer, redis, worker: "
                      + ", ".join(f"{k} {v:.1f}" for k, v in split.items()))  # fmt: skip


def _print_gateway(report: dict[str, Any], con: Console) -> None:
    g = report["gateway"]
    for m, ratio in g["throughput_over_direct"].items():
        rps = report["modes"]["gateway"][m]["throughput_rps"]
        con.print(f"gateway {m}: {_f(rps)} requests/s through the HTTP gateway = "
                  f"{_f(ratio, '.2f')}x the direct path (fleet) in this run")  # fmt: skip
    o = g["idle_overhead"]
    if o:
        con.print(f"gateway p50 overhead (idle, sync, {o['n']} pairs): "
                  f"{_f(o['overhead_p50_ms'], '.2f')} ms (direct p50 {o['direct_p50_ms']} "
                  f"ms, gateway p50 {o['gateway_p50_ms']} ms)")  # fmt: skip


def _latency_table(report: dict[str, Any]) -> Table:
    lat = Table(title="Latency, ms from the scheduled send (median across repetitions)")
    for col in ("modality", "priority", "mode", "n", "p50", "p95", "p99", "max", "miss",
                "queue p50", "compute p50", "drain/s"):  # fmt: skip
        lat.add_column(col, justify="left" if col in ("modality", "priority", "mode") else "right")
    for m in sorted({m for mode in report["latency_ms"].values() for m in mode}):
        prios = _prio_order(report, m)
        for p in prios:
            for mode in ("fleet", "baseline", *PEER_MODES, "metrics-on", "metrics-off"):
                s = report["latency_ms"].get(mode, {}).get(m, {}).get(p)
                if not s:
                    continue
                miss = report["deadline_misses"][mode][m].get(p)
                q = report["queue_wait_ms"][mode][m].get(p, {}).get("p50")
                c = report["compute_ms"][mode][m].get(p, {}).get("p50")
                stats = [_f(s[k]) for k in ("p50", "p95", "p99", "max")]
                miss_s = "-" if miss is None else f"{miss:.1%}"
                drain = report["modes"][mode][m].get("drain_rps", {}).get(p)
                lat.add_row(m, p, mode, str(s["n"]), *stats, miss_s, _f(q), _f(c), _f(drain))
    return lat


def _cold_table(report: dict[str, Any]) -> Table:
    cold = Table(title="Fresh worker and per-request overhead (ms)")
    for col in ("modality", "mode", "ready s", "first request", "warm idle", "idle overhead",
                "steady p50", "overhead p50"):  # fmt: skip
        cold.add_column(col, justify="left" if col in ("modality", "mode") else "right")
    for mode, mods in report["cold_start"].items():
        for m, c in mods.items():
            cold.add_row(m, mode, _f(c.get("ready_s")), _f(c.get("first_ms")),
                         _f(c.get("warm_idle_ms")), _f(c.get("idle_overhead_ms")),
                         _f(c.get("steady_p50_ms")),
                         _f(report["overhead_ms"][mode].get(m)))  # fmt: skip
    return cold


def _print_notes(report: dict[str, Any], con: Console) -> None:
    """Model busy share, the generator's lag, errors, warnings and the files written."""
    for mode, mods in report["batch_sizes"].items():
        for m, b in mods.items():
            if b.get("model_busy") is not None:
                con.print(
                    f"{mode}/{m}: inference threads ran batches {b['model_busy']:.0%} of each "
                    "repetition (median; first send to last result)"
                )
    for mode, phases in report["generator"].items():
        for name, g in phases.items():
            con.print(
                f"generator {mode}/{name} ({g['arrival']}, {g['requests']} sends): lag p50 "
                f"{g['p50_ms']:.1f} ms, p99 {g['p99_ms']:.1f} ms, max {g['max_ms']:.1f} ms, "
                f"{g['late_fraction']:.0%} over 10 ms late"
            )
    errs = {
        f"{mode}/{m}": e for mode, mods in report["errors"].items() for m, e in mods.items() if e
    }
    if errs:
        con.print("errors: " + "; ".join(f"{k} {v}" for k, v in errs.items()))
    for wmsg in report.get("warnings", []):
        con.print(f"[yellow]warning:[/yellow] {wmsg}")
    for k, v in report.get("files", {}).items():
        con.print(f"{k}: {v}")


def _prio_order(report: dict[str, Any], modality: str) -> list[str]:
    from producer.tools.bench.stats import ordered_priorities

    names = {p for mode in report["latency_ms"].values() for p in mode.get(modality, {})}
    return ordered_priorities(names)


def _throughput(report: dict[str, Any], con: Console) -> None:
    modes, n = report["modes"], report["repetitions"]
    t = Table(title=f"Throughput, requests/s: median of {n} (min-max)")
    for col in ("modality", "offered", "fleet", "baseline", "limit", "fleet/base",
                "fleet/limit", "fleet batches (size:count)"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("modality",) else "right")
    for m in sorted({m for mods in modes.values() for m in mods}):
        cells = []
        for mode in ("fleet", "baseline", "limit"):
            s = modes.get(mode, {}).get(m)
            extra = f" bs{s['best_batch_size']}" if mode == "limit" and s else ""
            cells.append(
                "-" if not s else _f(s["throughput_rps"]) + _range(s["throughput_spread"]) + extra
            )
        r = report["ratios"].get(m, {})
        bs = report["batch_sizes"].get("fleet", {}).get(m, {}).get("batches", {})
        top = sorted(bs.items(), key=lambda kv: -kv[1])[:4]
        ratios = [_f(r.get(k), ".2f") for k in ("fleet_over_baseline", "fleet_over_limit")]
        offered = _f(modes.get("fleet", {}).get(m, {}).get("offered_rps"))
        t.add_row(m, offered, *cells, *ratios, " ".join(f"{k}:{v}" for k, v in top))
    con.print(t)
