"""producer.tools.bench.scaleout: the model of many worker hosts against one Redis (no servers)."""

from __future__ import annotations

import pytest

from producer.tools.bench.scaleout import (
    Costs,
    costs_from,
    host_rate,
    main,
    saturation,
    saturation_hosts,
    simulate,
)

COSTS = Costs(
    host_rps=100.0,
    commands_per_request=10.0,
    cpu_us_per_request=500.0,
    idle_cpu_us_per_s=1000.0,
    idle_commands_per_s=10.0,
)


def test_the_same_inputs_give_the_same_row() -> None:
    assert simulate(COSTS, 5, 0.8, 0.2) == simulate(COSTS, 5, 0.8, 0.2)


def test_below_saturation_every_offered_request_completes() -> None:
    row = simulate(COSTS, 10, 0.8, 0.2)
    # 10 hosts x 80 requests/s x 500 us + 10 x 1000 us per second = 0.41 of one core
    assert row.utilisation == pytest.approx(0.41)
    assert row.achieved_rps == row.offered_rps == pytest.approx(800.0)
    assert row.commands_per_s == pytest.approx(8100.0)
    assert row.wait_mean_us is not None and row.wait_p99_us is not None
    assert 0 < row.wait_mean_us < row.wait_p99_us


def test_waits_grow_with_utilisation() -> None:
    low, high = simulate(COSTS, 5, 0.8, 0.5), simulate(COSTS, 22, 0.8, 0.5)
    assert low.wait_mean_us is not None and high.wait_mean_us is not None
    assert high.wait_mean_us > 3 * low.wait_mean_us


def test_past_saturation_throughput_is_what_redis_completes() -> None:
    row = simulate(COSTS, 50, 0.8, 0.2)
    assert row.utilisation > 1 and row.wait_mean_us is None
    # one core minus 50 hosts' background, at 500 us a request
    assert row.achieved_rps == pytest.approx((1e6 - 50 * 1000.0) / 500.0)
    assert simulate(COSTS, 60, 0.8, 0.2).achieved_rps < row.achieved_rps  # more hosts, less


def test_the_closed_form_saturation_point_matches_the_simulation() -> None:
    n = saturation_hosts(COSTS, 0.8, 1.0)
    assert n == pytest.approx(1e6 / (80 * 500.0 + 1000.0))
    assert (
        simulate(COSTS, int(n), 0.8, 0.1).utilisation
        < 1
        <= simulate(COSTS, int(n) + 1, 0.8, 0.1).utilisation
    )


def test_saturation_gives_hosts_and_requests_per_second() -> None:
    sat = saturation(COSTS, 0.8)
    hosts = 1e6 / (80 * 500.0 + 1000.0)
    assert sat["hosts_at_100pct"] == pytest.approx(hosts, abs=0.05)
    assert sat["rps_at_100pct"] == pytest.approx(hosts * 80, abs=1)
    assert sat["rps_at_50pct"] == pytest.approx(hosts * 40, abs=1)
    assert sat["ceiling_rps"] == 2000  # 1 s / 500 us, no background


def _report(model: str, workers: int, per_worker: bool = True) -> dict:
    idle = {"s": 10.0, "commands_per_s": 20.0, "cpu_us_per_s": 4000}
    if per_worker:
        idle["per_worker"] = {"commands_per_s": 20.0 / workers, "cpu_us_per_s": 4000 / workers}
    return {
        "model": model,
        "workers": workers,
        "idle": idle,
        "load": {"requests": 3000, "rps": 900.0, "commands_per_request": 11.5,
                 "cpu_us_per_request": 60.0},
    }  # fmt: skip


@pytest.mark.parametrize("per_worker", [True, False])
def test_the_idle_background_is_one_workers(per_worker: bool) -> None:
    costs = costs_from(_report("identity", 2, per_worker), 100.0)
    assert costs.idle_cpu_us_per_s == pytest.approx(2000.0)
    assert costs.idle_commands_per_s == pytest.approx(10.0)
    assert costs.cpu_us_per_request == 60.0 and costs.commands_per_request == 11.5


def test_the_host_rate_of_a_model_without_a_bench_figure_is_its_drain_rate() -> None:
    rate, source = host_rate(None, None, _report("identity", 2))
    assert rate == 450.0 and "drain rate" in source
    assert host_rate(None, 123.0, _report("identity", 2)) == (123.0, "--host-rps (given)")
    rate, source = host_rate(None, None, _report("minilm", 1))  # deploy/k8s/measured.json
    assert rate > 0 and "drain rate" not in source


def test_main_writes_one_entry_per_report(tmp_path, capsys) -> None:
    import json

    paths = []
    for model in ("minilm", "identity"):
        paths += ["--redis", str(tmp_path / f"{model}.json")]
        (tmp_path / f"{model}.json").write_text(json.dumps(_report(model, 1)))
    out = tmp_path / "scaleout.json"
    assert main([*paths, "--hosts", "1,10", "--sim-s", "0.01", "--json", str(out)]) == 0
    entries = json.loads(out.read_text())["scaleout"]
    assert [e["model"] for e in entries] == ["minilm", "identity"]
    assert [r["hosts"] for r in entries[1]["rows"]] == [1, 10]
    assert entries[1]["saturation"]["ceiling_rps"] == round(1e6 / 60.0)
    assert "== identity model" in capsys.readouterr().out
