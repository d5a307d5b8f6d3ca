"""``fleet bench --metrics-cost``: the variants' settings, the interleaving, the cost figures."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from rich.console import Console

from producer.tools.bench.metricscost import (
    CostBench,
    CostOptions,
    cost_warnings,
    mode_name,
    print_cost,
    round_order,
    summarize_cost,
    variant_env,
    with_round_s,
)
from producer.tools.bench.runner import BenchError, BenchOptions, BenchResult, ModeResult
from producer.tools.bench.workload import load_workload
from shared import tracing
from shared.settings import load_settings


@pytest.fixture(autouse=True)
def _no_fleet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("FLEET_"):
            monkeypatch.delenv(name)


def test_rounds_alternate_which_variant_runs_first() -> None:
    orders = [round_order(i) for i in range(4)]
    assert orders == [("on", "off"), ("off", "on"), ("on", "off"), ("off", "on")]


def test_the_variants_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name, value in variant_env("on", tmp_path, 40100).items():
        monkeypatch.setenv(name, value)
    on = load_settings()
    assert on.metrics.enabled and on.metrics.port_base == 40100
    assert tracing.enabled(on) and on.tracing.file == str(tmp_path / "spans.jsonl")
    assert on.tracing.sample_ratio == 0.01 and on.tracing.otlp_endpoint == ""

    for name, value in variant_env("off", tmp_path, 40200).items():
        monkeypatch.setenv(name, value)
    off = load_settings()
    # The port stays set: an off worker that still served /metrics would be caught.
    assert not off.metrics.enabled and off.metrics.port_base == 40200
    assert not tracing.enabled(off)
    with pytest.raises(ValueError):
        variant_env("half", tmp_path, 1)


def test_round_s_sets_every_timed_phase() -> None:
    w = load_workload("priority-burst")
    short = with_round_s(w, 4.0)
    for before, after in zip(w.phases, short.phases, strict=True):
        if before.arrival == "burst":
            assert after == before
        else:
            assert after.duration_s == 4.0 and after.count is None
    assert with_round_s(w, None) is w


def test_a_round_within_the_warmup_is_refused() -> None:
    w = load_workload("text-saturate")  # warmup_s 3
    with pytest.raises(BenchError, match="warmup"):
        CostBench(BenchOptions(w), CostOptions(rounds=2, round_s=3.0))
    with pytest.raises(BenchError, match="rounds"):
        CostBench(BenchOptions(w), CostOptions(rounds=0))


def _result(on: list[float], off: list[float]) -> BenchResult:
    res = BenchResult(load_workload("text-saturate"), len(on), "2026-12-02T00:00:00+00:00")
    for variant, xs in (("on", on), ("off", off)):
        mr = ModeResult(mode_name(variant))
        mr.summaries = [{"modalities": {"text": {"throughput_rps": x}}} for x in xs]
        mr.reps = [[] for _ in xs]
        res.modes[mode_name(variant)] = mr
    return res


def _checks(**off_facts: object) -> list[dict[str, object]]:
    on = {"metrics_enabled": True, "tracing": True, "metrics_served": True}
    off = {"metrics_enabled": False, "tracing": False, "metrics_served": False, **off_facts}
    return [{"round": 1, "variant": v, "modality": "text", **f} for v, f in
            (("on", on), ("off", off))]  # fmt: skip


def _printed(mc: dict[str, object]) -> str:
    out = io.StringIO()
    print_cost({"metrics_cost": mc}, Console(file=out, width=300))
    return out.getvalue()


def test_the_cost_is_the_medians_relative_difference() -> None:
    res = _result(on=[99.0, 99.2, 98.8], off=[100.0, 100.0, 100.0])
    spans = {"exported": 12, "traces": 6, "by_name": {}}
    mc = summarize_cost(res, ["on", "off", "off", "on", "on", "off"], _checks(), spans)
    assert mc["median_on"] == 99.0 and mc["median_off"] == 100.0
    assert mc["cost_pct"] == pytest.approx(1.0)
    assert mc["round_cost_pct"] == pytest.approx([1.0, 0.8, 1.2])
    assert mc["round_cost_spread"] == pytest.approx({"min": 0.8, "median": 1.0, "max": 1.2})
    assert mc["spread_pct"]["on"] == pytest.approx(0.4 / 99.0 * 100)
    assert mc["spread_pct"]["off"] == 0.0
    # mean 1.0, sd 0.2, t(2) = 4.303: 1.0 +- 0.497, wholly under 3 %
    assert mc["mean_round_cost_pct"] == pytest.approx(1.0)
    assert mc["round_cost_ci95_pct"] == pytest.approx([1.0 - 0.4969, 1.0 + 0.4969], abs=1e-3)
    assert mc["within_target"] is True and mc["resolved"] is True
    assert cost_warnings(mc) == []
    assert "+1.00 %" in _printed(mc) and "(within the 3 % target)" in _printed(mc)


def test_an_interval_wholly_above_the_target_is_over() -> None:
    res = _result(on=[90.0, 90.5, 89.5], off=[100.0, 100.0, 100.0])
    spans = {"exported": 12, "traces": 6, "by_name": {}}
    mc = summarize_cost(res, ["on", "off", "off", "on", "on", "off"], _checks(), spans)
    assert mc["resolved"] is True and mc["within_target"] is False
    assert mc["round_cost_ci95_pct"][0] > 3.0
    assert "(over the 3 % target)" in _printed(mc)


def test_rounds_that_disagree_more_than_the_target_give_no_verdict() -> None:
    res = _result(on=[97.0, 99.0, 95.0], off=[100.0, 100.0, 100.0])
    spans = {"exported": 12, "traces": 6, "by_name": {}}
    mc = summarize_cost(res, ["on", "off", "off", "on", "on", "off"], _checks(), spans)
    assert mc["cost_pct"] == pytest.approx(3.0) and mc["within_target"] is True
    assert mc["round_cost_pct"] == pytest.approx([3.0, 1.0, 5.0])
    assert mc["resolved"] is False  # 3 +- 4.97: the interval holds 3 %
    warnings = cost_warnings(mc)
    assert len(warnings) == 1 and "95 % interval -1.97 .. +7.97 % straddles" in warnings[0]
    assert "not resolved by these rounds against the 3 % target" in _printed(mc)


def test_a_switch_that_did_not_take_is_a_warning() -> None:
    res = _result(on=[90.0, 91.0], off=[100.0, 100.0])
    spans = {"exported": 0, "traces": 0, "by_name": {}}
    mc = summarize_cost(res, ["on", "off", "off", "on"], _checks(metrics_served=True), spans)
    assert mc["within_target"] is False and mc["cost_pct"] == pytest.approx(9.5)
    assert cost_warnings(mc) == [
        "metrics cost: round 1, variant off: the text worker ran with metrics False, /metrics "
        "served True, tracing False: the comparison is not what it says"
    ]
