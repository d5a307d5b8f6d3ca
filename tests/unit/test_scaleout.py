"""producer.tools.bench.scaleout: the model of many worker hosts against one Redis (no servers)."""

from __future__ import annotations

import pytest

from producer.tools.bench.scaleout import Costs, saturation_hosts, simulate

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
