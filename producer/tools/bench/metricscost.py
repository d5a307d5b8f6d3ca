"""``fleet bench WORKLOAD --metrics-cost``: the fleet's throughput with metrics and tracing on
vs off, interleaved in one run (``make bench WORKLOAD=text-saturate METRICS_COST=1``).

Variants (everything else is the bench's ``fleet`` mode, same Redis, inputs and schedule):

- ``on``: ``[metrics] enabled = true`` with each worker's ``/metrics`` served on a free
  loopback port, and tracing on with the file exporter (``[tracing] file`` in the run dir,
  ``sample_ratio = 0.01``) in the workers and in the bench's own producer, whose
  ``fleet.submit`` span decides the sampling (workers follow its ``traceparent``).
- ``off``: ``[metrics] enabled = false`` (null metrics, no ``/metrics``: the port stays
  configured, so the check below proves the switch and not a missing port) and tracing off
  (no endpoint, no file: the shipped default).

Each round runs both, in alternating order (on, off | off, on | on, off ...) so that a drift
of the machine's load over the run falls on both alike; each variant gets fresh workers
started with its environment, then one repetition of the workload (every non-burst phase
``round_s`` long when given). Per round and variant the report records the throughput
(requests/s summed over the workload's modalities) and what the workers say they ran with
(``fleet_stats``: ``metrics_enabled``, ``tracing``; ``/metrics`` answering or refused, and
its ``fleet_requests_total`` of successes when on). The cost is
``(median_off - median_on) / median_off`` in percent; ``round_cost_pct`` holds each round's
own pair, whose spread says how far the median can be trusted.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from producer.client import FleetClient
from producer.stack.ports import free_port
from producer.tools.bench.results import merge_mode
from producer.tools.bench.runner import Bench, BenchError, BenchOptions, BenchResult, ModeResult
from producer.tools.bench.stats import median, spread
from producer.tools.bench.workerstats import fleet_stats
from producer.tools.bench.workload import Workload
from shared import tracing
from shared.settings import MODALITIES, Settings, load_settings

VARIANTS = ("on", "off")
SAMPLE_RATIO = 0.01
TARGET_PCT = 3.0  # the goal: at most 3 % of throughput with metrics on, tracing at 1 %
SPANS_FILE = "spans.jsonl"


@dataclass(frozen=True)
class CostOptions:
    """``rounds``: on/off pairs; ``round_s``: each non-burst phase's duration, seconds, its
    first ``warmup_s`` unmeasured as always (``None``: the workload's own)."""

    rounds: int = 4
    round_s: float | None = None


def mode_name(variant: str) -> str:
    """The report's mode key of a variant: ``metrics-on`` / ``metrics-off``."""
    return f"metrics-{variant}"


def round_order(i: int) -> tuple[str, str]:
    """Variants of round ``i`` (0-based), in the order they run: alternating."""
    return VARIANTS if i % 2 == 0 else VARIANTS[::-1]


def variant_env(variant: str, run_dir: Path, port_base: int) -> dict[str, str]:
    """The ``FLEET_*`` variables of a variant (workers inherit them; so does the producer)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r} is not one of {VARIANTS}")
    on = variant == "on"
    return {
        "FLEET_METRICS__ENABLED": "true" if on else "false",
        "FLEET_METRICS__PORT_BASE": str(port_base),
        "FLEET_TRACING__OTLP_ENDPOINT": "",
        "FLEET_TRACING__FILE": str(run_dir / SPANS_FILE) if on else "",
        "FLEET_TRACING__SAMPLE_RATIO": str(SAMPLE_RATIO) if on else "1.0",
    }


def with_round_s(w: Workload, round_s: float | None) -> Workload:
    """``w`` with every non-burst phase ``round_s`` long (``None``: ``w`` itself)."""
    if round_s is None:
        return w
    phases = [
        p if p.arrival == "burst" else p.model_copy(update={"duration_s": round_s, "count": None})
        for p in w.phases
    ]
    return w.model_copy(update={"phases": phases})


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[Settings]:
    """``env`` set for the block (restored after); the producer's tracing follows it."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    tracing.reset()  # the next FleetClient configures this variant's provider
    try:
        yield load_settings()
    finally:
        tracing.reset()  # flushes the producer's spans
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class CostBench(Bench):
    """The ``fleet`` mode, alternately with metrics+tracing on and off. See the module."""

    def __init__(self, opts: BenchOptions, cost: CostOptions, console: Console | None = None):
        warmup_s = opts.workload.warmup_s
        if cost.rounds < 1:
            raise BenchError("--cost-rounds must be at least 1")
        if cost.round_s is not None and cost.round_s <= warmup_s:
            raise BenchError(
                f"--cost-round-s {cost.round_s:g} leaves nothing to measure: the workload's "
                f"first {warmup_s:g} s are its warmup"
            )
        w = with_round_s(opts.workload, cost.round_s)
        super().__init__(
            BenchOptions(w, ("fleet",), repetitions=1, run_dir=opts.run_dir), console=console
        )
        self.cost = cost
        self._round, self._variant = 0, ""
        self._port_base = 0
        self._host = "127.0.0.1"
        self._checks: list[dict[str, Any]] = []

    def _run_modes(self, stack: Any, settings: Settings, res: BenchResult) -> None:
        res.repetitions = self.cost.rounds
        self._host = settings.metrics.host
        run_dir = Path(res.run_dir)
        order: list[str] = []
        for i in range(self.cost.rounds):
            for variant in round_order(i):
                self.console.print(
                    f"round {i + 1}/{self.cost.rounds}: metrics and tracing {variant}"
                )
                self._round, self._variant, self._port_base = i + 1, variant, free_port()
                with _environment(variant_env(variant, run_dir, self._port_base)) as vs:
                    one = self._service_mode("fleet", stack, vs, res)
                name = mode_name(variant)
                merge_mode(res.modes.setdefault(name, ModeResult(name)), one)
                order.append(variant)
        res.metrics_cost = summarize_cost(
            res, order, self._checks, count_spans(run_dir / SPANS_FILE)
        )
        res.metrics_cost["round_s"] = self.cost.round_s
        res.notes.extend(cost_warnings(res.metrics_cost))

    def _measured(self, mode: str, client: FleetClient) -> None:
        """What the workers of this variant run with, read while they are up."""
        stats = fleet_stats(client, len(self.modalities))
        for m in self.modalities:
            s = stats.get(m, {})
            port = self._port_base + MODALITIES.index(m)
            self._checks.append(
                {
                    "round": self._round,
                    "variant": self._variant,
                    "modality": m,
                    "metrics_enabled": s.get("metrics_enabled"),
                    "tracing": s.get("tracing"),
                    **scrape(self._host, port, m),
                }
            )


def scrape(host: str, port: int, modality: str) -> dict[str, Any]:
    """``metrics_served`` (``/metrics`` answered) and, if so, ``metrics_requests_ok``: the
    worker's ``fleet_requests_total`` of successes of ``modality``."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5.0) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return {"metrics_served": False, "metrics_requests_ok": None}
    ok = 0.0
    for line in text.splitlines():
        if (
            line.startswith("fleet_requests_total{")
            and f'modality="{modality}"' in line
            and 'outcome="ok"' in line
        ):
            ok += float(line.rsplit(" ", 1)[1])
    return {"metrics_served": True, "metrics_requests_ok": int(ok)}


def count_spans(path: Path) -> dict[str, Any]:
    """Spans the file exporter wrote: ``exported``, ``traces`` (distinct trace ids) and
    ``by_name``."""
    names: Counter[str] = Counter()
    traces: set[str] = set()
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                span = json.loads(line)
                names[str(span.get("name"))] += 1
                traces.add(str(span.get("context", {}).get("trace_id")))
    return {"exported": sum(names.values()), "traces": len(traces), "by_name": dict(names)}


def round_rps(summary: dict[str, Any]) -> float | None:
    """A repetition's throughput summed over its modalities (``None`` if one has none)."""
    vals = [s.get("throughput_rps") for s in summary.get("modalities", {}).values()]
    return None if not vals or any(v is None for v in vals) else float(sum(vals))


def _relative_spread_pct(xs: list[float | None]) -> float | None:
    """(max - min) / median of ``xs``, in percent; ``None`` under two values."""
    sp = spread(xs)
    if sp is None or not sp["median"] or sum(x is not None for x in xs) < 2:
        return None
    return (sp["max"] - sp["min"]) / sp["median"] * 100


def _pct(on: float | None, off: float | None) -> float | None:
    return None if on is None or not off else (off - on) / off * 100.0


# Student's t, two-sided 95 %, for 1..30 degrees of freedom (then the normal's 1.96).
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def paired_ci95(round_costs: list[float | None]) -> tuple[float, float, float] | None:
    """``(mean, low, high)``: the mean of the rounds' paired costs (percent) and its 95 %
    confidence interval (Student's t over the rounds); ``None`` under two rounds. Each round
    runs both variants back to back, so a round's cost is a paired difference: the drift
    between rounds cancels, the noise inside a round is what the interval measures."""
    xs = [x for x in round_costs if x is not None]
    if len(xs) < 2:
        return None
    mean = statistics.fmean(xs)
    t = _T975[len(xs) - 2] if len(xs) - 1 <= len(_T975) else 1.96
    half = t * statistics.stdev(xs) / math.sqrt(len(xs))
    return mean, mean - half, mean + half


def resolved(round_costs: list[float | None]) -> bool:
    """Whether the rounds decide against the target: the 95 % interval of the paired cost
    lies wholly at or below ``TARGET_PCT`` (within) or wholly above it (over)."""
    ci = paired_ci95(round_costs)
    return ci is not None and (ci[2] <= TARGET_PCT or ci[1] > TARGET_PCT)


def summarize_cost(
    res: BenchResult, order: list[str], checks: list[dict[str, Any]], spans: dict[str, Any]
) -> dict[str, Any]:
    """The report's ``metrics_cost`` section (layout: ``producer/tools/bench/report.py``)."""
    runs = {v: res.modes.get(mode_name(v)) or ModeResult(mode_name(v)) for v in VARIANTS}
    per = {v: [round_rps(s) for s in mr.summaries] for v, mr in runs.items()}
    sent = {v: sum(len(recs) for recs in mr.reps) for v, mr in runs.items()}
    if sent["on"]:
        spans = {**spans, "sampled_share": spans["traces"] / sent["on"]}
    med_on = median([x for x in per["on"] if x is not None])
    med_off = median([x for x in per["off"] if x is not None])
    pairs = [_pct(a, b) for a, b in zip(per["on"], per["off"], strict=False)]
    cost = _pct(med_on, med_off)
    rel = {v: _relative_spread_pct(per[v]) for v in VARIANTS}
    ci = paired_ci95(pairs)
    decided = resolved(pairs)
    within = None if cost is None else cost <= TARGET_PCT
    if decided and ci is not None:
        within = ci[2] <= TARGET_PCT
    return {
        "modalities": res.workload.modalities,
        "rounds": len(per["on"]),
        "order": order,
        "on": per["on"],
        "off": per["off"],
        "median_on": med_on,
        "median_off": med_off,
        "cost_pct": cost,
        "round_cost_pct": pairs,
        "round_cost_spread": spread(pairs),
        "mean_round_cost_pct": None if ci is None else ci[0],
        "round_cost_ci95_pct": None if ci is None else [ci[1], ci[2]],
        "spread_pct": rel,
        "target_pct": TARGET_PCT,
        "within_target": within,
        "resolved": decided,
        "sample_ratio": SAMPLE_RATIO,
        "requests": sent,
        "checks": checks,
        "spans": spans,
    }


def cost_warnings(mc: dict[str, Any]) -> list[str]:
    """What makes the cost of this run doubtful: a switch that did not take, or noise."""
    out = []
    for c in mc["checks"]:
        on = c["variant"] == "on"
        if (
            c["metrics_enabled"] is not on
            or c["metrics_served"] is not on
            or c["tracing"] is not on
        ):
            out.append(
                f"metrics cost: round {c['round']}, variant {c['variant']}: the "
                f"{c['modality']} worker ran with metrics "
                f"{c['metrics_enabled']}, /metrics served {c['metrics_served']}, tracing "
                f"{c['tracing']}: the comparison is not what it says"
            )
    ci = mc["round_cost_ci95_pct"]
    if ci is not None and not mc["resolved"]:
        out.append(
            f"metrics cost: the paired cost's 95 % interval {_ci(ci)} % straddles the "
            f"{TARGET_PCT:.0f} % target: rerun with more or longer rounds, on a quieter machine"
        )
    if mc["rounds"] < 2:
        out.append("metrics cost: one round: no spread to judge the difference by")
    expected = mc["requests"].get("on", 0) * mc["sample_ratio"]
    if mc["spans"]["exported"] == 0 and expected >= 5:
        out.append(
            f"metrics cost: tracing was on but no span was exported (about {expected:.0f} "
            "sampled traces expected)"
        )
    return out


def print_cost(report: dict[str, Any], con: Console) -> None:
    """The ``metrics_cost`` section as a table and one summary line."""
    mc = report["metrics_cost"]
    t = Table(title="Metrics and tracing cost: throughput, requests/s, per round")
    for col in ("round", "order", "on", "off", "cost %"):
        t.add_column(col, justify="left" if col in ("round", "order") else "right")
    pairs = mc["round_cost_pct"]
    for i, (on, off) in enumerate(zip(mc["on"], mc["off"], strict=False)):
        order = ",".join(mc["order"][2 * i : 2 * i + 2])
        t.add_row(str(i + 1), order, _f(on), _f(off), _f(pairs[i], "+.2f"))
    con.print(t)
    sp = mc["round_cost_spread"] or {}
    within = {True: "within", False: "over", None: "no verdict on"}[mc["within_target"]]
    if not mc["resolved"]:
        within = "not resolved by these rounds against"
    con.print(
        f"metrics cost ({', '.join(mc['modalities'])}): median on {_f(mc['median_on'])}, "
        f"off {_f(mc['median_off'])} requests/s: [bold]{_f(mc['cost_pct'], '+.2f')} %[/bold] "
        f"with metrics on and tracing sampled {mc['sample_ratio']:.0%} ({within} the "
        f"{mc['target_pct']:.0f} % target); per round {_f(sp.get('min'), '+.2f')} .. "
        f"{_f(sp.get('max'), '+.2f')} %, paired mean {_f(mc['mean_round_cost_pct'], '+.2f')} % "
        f"(95 % CI {_ci(mc['round_cost_ci95_pct'])}); round-to-round spread on "
        f"{_f(mc['spread_pct'].get('on'))} %, off {_f(mc['spread_pct'].get('off'))} %; "
        f"{mc['spans']['exported']} spans of {mc['spans']['traces']} traces exported"
    )


def _ci(ci: list[float] | None) -> str:
    return "-" if ci is None else f"{ci[0]:+.2f} .. {ci[1]:+.2f}"


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)
