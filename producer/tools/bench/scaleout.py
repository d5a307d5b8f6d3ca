"""``python -m producer.tools.bench.scaleout``: 1 to 100 worker hosts against one Redis, simulated
from measured costs. Where does Redis itself saturate?

Inputs (all measured, none assumed unless given on the command line):

- Redis's cost per request and per idle worker, one ``python -m producer.tools.bench.redisload``
  JSON per ``--redis`` (repeatable: ``make scaleout`` gives the MiniLM and the identity
  model's): commands per request, Redis CPU microseconds per request, and one idle worker's
  background CPU microseconds per second (``idle.per_worker`` when the run had several
  workers);
- one worker host's service rate (requests/s): ``--host-rps`` if given; else for a report of
  the ``minilm`` model ``modes.fleet.text.throughput_rps`` of a ``make bench`` report
  (``--bench``), else ``deploy/k8s/measured.json``'s text ``rate_per_s`` (the
  ``text-saturate`` figure); for any other model (``identity``) the report's own drain rate
  per worker (``load.rps`` / ``workers``: a queue of requests enqueued at once, drained at
  the workers' full speed).

Model: Redis is one server running commands one at a time (its main thread). Each host
offers ``load`` x its service rate; every request brings ``commands_per_request`` commands
of equal service time (CPU per request / commands per request) and every host adds its
background. Command arrivals are Poisson (a seeded generator: the same inputs print the same
table), served first come first served; the waiting time of each command follows Lindley's
recursion over ``sim_s`` simulated seconds. When the offered Redis work exceeds one second
per second the fleet's throughput is capped at what Redis completes: adding hosts adds
nothing.

Prints, per report: per host count, offered and achieved requests/s, Redis utilisation,
commands/s, and the mean and p99 wait of a command inside Redis (what every round trip a
request makes pays on top of its service time); then the saturation point in closed form
(:func:`saturation`): the hosts, and the requests/s, at which Redis is 50 %, 80 % and 100 %
busy, and the ceiling with no worker's background (1 s / CPU per request). ``--json`` writes
``{"scaleout": [{"model", "workers", "redis_report", "host_rps", "host_rps_source", "load",
"costs", "saturation", "rows"}, ...]}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[3]
DEFAULT_HOSTS = (1, 2, 5, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100)


@dataclass(frozen=True)
class Costs:
    """Measured inputs of the model (units in the names)."""

    host_rps: float  # one worker host's service rate
    commands_per_request: float
    cpu_us_per_request: float  # Redis CPU per request, the idle background removed
    idle_cpu_us_per_s: float  # one idle worker's background Redis CPU per second
    idle_commands_per_s: float


@dataclass(frozen=True)
class Row:
    hosts: int
    offered_rps: float
    achieved_rps: float
    utilisation: float  # offered Redis work per second of Redis time (>= 1: saturated)
    commands_per_s: float
    wait_mean_us: float | None  # None: saturated, the queue grows without bound
    wait_p99_us: float | None


def simulate(costs: Costs, hosts: int, load: float, sim_s: float, seed: int = 0) -> Row:
    """One host count: ``hosts`` x ``load`` x ``costs.host_rps`` requests/s offered.

    Returns the row; waits are ``None`` when Redis is saturated (utilisation >= 1).
    """
    offered = hosts * load * costs.host_rps
    cmd_rate = offered * costs.commands_per_request + hosts * costs.idle_commands_per_s
    busy = offered * costs.cpu_us_per_request + hosts * costs.idle_cpu_us_per_s
    utilisation = busy / 1e6
    if utilisation >= 1.0:
        spare = 1e6 - hosts * costs.idle_cpu_us_per_s
        achieved = max(spare, 0.0) / costs.cpu_us_per_request
        return Row(hosts, offered, achieved, utilisation, cmd_rate, None, None)
    # Background commands are given the same mean service time, scaled so the busy time
    # matches the measured CPU.
    mean_service_us = busy / cmd_rate
    rng = np.random.default_rng(seed + hosts)
    n = max(int(cmd_rate * sim_s), 1000)
    gaps_us = rng.exponential(1e6 / cmd_rate, n)
    wait = np.empty(n)
    w = 0.0
    for i in range(n):  # Lindley: W[i+1] = max(0, W[i] + S - A[i+1])
        wait[i] = w
        w = max(0.0, w + mean_service_us - gaps_us[i])
    return Row(
        hosts,
        offered,
        offered,
        utilisation,
        cmd_rate,
        float(wait.mean()),
        float(np.percentile(wait, 99)),
    )


def costs_from(redis_json: dict[str, Any], host_rps: float) -> Costs:
    """The model's inputs from a redisload report; the idle background is one worker's."""
    load, idle = redis_json["load"], redis_json["idle"]
    workers = int(redis_json.get("workers") or 1)
    per_worker = idle.get("per_worker") or {
        "cpu_us_per_s": idle["cpu_us_per_s"] / workers,
        "commands_per_s": idle["commands_per_s"] / workers,
    }
    return Costs(
        host_rps=host_rps,
        commands_per_request=float(load["commands_per_request"]),
        cpu_us_per_request=float(load["cpu_us_per_request"]),
        idle_cpu_us_per_s=float(per_worker["cpu_us_per_s"]),
        idle_commands_per_s=float(per_worker["commands_per_s"]),
    )


def host_rate(
    bench: Path | None, host_rps: float | None, redis_json: dict[str, Any] | None = None
) -> tuple[float, str]:
    """One host's text service rate and where it came from (module doc)."""
    if host_rps:
        return host_rps, "--host-rps (given)"
    model = (redis_json or {}).get("model", "minilm")
    if redis_json is not None and model != "minilm":
        workers = int(redis_json.get("workers") or 1)
        rate = float(redis_json["load"]["rps"]) / workers
        return rate, f"the redisload run's drain rate per worker ({model} model)"
    if bench is not None:
        rep = json.loads(bench.read_text())
        return float(rep["modes"]["fleet"]["text"]["throughput_rps"]), str(bench)
    measured = json.loads((REPO / "deploy/k8s/measured.json").read_text())
    text = measured["modalities"]["text"]
    return float(text["rate_per_s"]), text["rate_source"]


def saturation_hosts(costs: Costs, load: float, utilisation: float) -> float:
    """Hosts at which Redis reaches ``utilisation`` (closed form of the same model)."""
    per_host = load * costs.host_rps * costs.cpu_us_per_request + costs.idle_cpu_us_per_s
    return utilisation * 1e6 / per_host


def saturation(costs: Costs, load: float) -> dict[str, float]:
    """Where one Redis saturates, in closed form: hosts and requests/s at 50 %, 80 % and 100 %
    busy, and ``ceiling_rps`` (1 s / CPU per request: no worker's background at all)."""
    out: dict[str, float] = {}
    for u in (0.5, 0.8, 1.0):
        hosts = saturation_hosts(costs, load, u)
        out[f"hosts_at_{round(u * 100)}pct"] = round(hosts, 1)
        out[f"rps_at_{round(u * 100)}pct"] = round(hosts * load * costs.host_rps)
    out["ceiling_rps"] = round(1e6 / costs.cpu_us_per_request)
    return out


def table(rows: list[Row]) -> str:
    head = (
        f"{'hosts':>5} {'offered/s':>10} {'achieved/s':>11} {'Redis util':>10} "
        f"{'cmds/s':>9} {'wait mean us':>12} {'wait p99 us':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        mean = f"{r.wait_mean_us:12.0f}" if r.wait_mean_us is not None else f"{'saturated':>12}"
        p99 = f"{r.wait_p99_us:11.0f}" if r.wait_p99_us is not None else f"{'-':>11}"
        lines.append(
            f"{r.hosts:5d} {r.offered_rps:10.0f} {r.achieved_rps:11.0f} {r.utilisation:10.2f} "
            f"{r.commands_per_s:9.0f} {mean} {p99}"
        )
    return "\n".join(lines)


def run_one(
    path: Path, bench: Path | None, host_rps: float | None, load: float, hosts: str, sim_s: float
) -> dict[str, Any]:
    """One redisload report through the simulation: prints its table, returns its JSON."""
    rep = json.loads(path.read_text())
    rate, source = host_rate(bench, host_rps, rep)
    costs = costs_from(rep, rate)
    rows = [simulate(costs, int(h), load, sim_s) for h in hosts.split(",")]
    model, workers = rep.get("model", "minilm"), int(rep.get("workers") or 1)
    sat = saturation(costs, load)
    print(f"== {model} model ({path}, {workers} worker(s) measured)")
    print(f"one host: {rate:g} requests/s ({source}); offered {load:.0%} of it")
    print(
        f"Redis per request: {costs.commands_per_request:g} commands, "
        f"{costs.cpu_us_per_request:g} us CPU; per idle worker: "
        f"{costs.idle_commands_per_s:g} commands/s, {costs.idle_cpu_us_per_s:g} us CPU/s"
    )
    print(table(rows))
    for u in (50, 80, 100):
        print(
            f"Redis at {u}% busy from {sat[f'hosts_at_{u}pct']:.1f} hosts, "
            f"{sat[f'rps_at_{u}pct']:,.0f} requests/s"
        )
    print(f"ceiling with no worker's background: {sat['ceiling_rps']:,.0f} requests/s")
    return {
        "model": model,
        "workers": workers,
        "redis_report": str(path),
        "host_rps": rate,
        "host_rps_source": source,
        "load": load,
        "costs": costs.__dict__,
        "saturation": sat,
        "rows": [r.__dict__ for r in rows],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--redis", type=Path, action="append", required=True, help="redisload JSON (repeatable)"
    )
    p.add_argument("--bench", type=Path, default=None, help="a make bench report JSON")
    p.add_argument("--host-rps", type=float, default=None, help="one host's rate (requests/s)")
    p.add_argument("--load", type=float, default=0.8, help="offered share of host capacity")
    p.add_argument("--hosts", default=",".join(map(str, DEFAULT_HOSTS)))
    p.add_argument("--sim-s", type=float, default=0.5, help="simulated seconds per row")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    results = []
    for i, path in enumerate(args.redis):
        if i:
            print()
        results.append(run_one(path, args.bench, args.host_rps, args.load, args.hosts, args.sim_s))
    if args.json:
        args.json.write_text(json.dumps({"scaleout": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
