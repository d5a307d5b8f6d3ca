"""``make gpu-check``'s benches: the plan, its time budget, the shortened workloads, the
verdict on a report and the run loop's deadline (no servers, no GPU)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from producer.tools.bench.workload import parse_workload
from producer.tools.gpucheck import benches
from producer.tools.gpucheck.benches import (
    BUDGET_S,
    DEVICE_CHECKS_S,
    PARTS,
    BenchPart,
    PartResult,
    PlanError,
    bench_env,
    plan,
    run_parts,
    summarise,
    workload_text,
)
from producer.tools.gpucheck.cli import main


def test_the_whole_check_fits_ten_minutes_with_room_to_spare() -> None:
    assert BUDGET_S <= 600 - 60  # a minute for the interpreter, torch's import, the report
    planned = plan(list(PARTS))
    assert [p.name for p, _ in planned] == ["overhead", "text", "image"]
    assert all(skip is None for _, skip in planned)
    total = DEVICE_CHECKS_S + sum(p.estimate_s() for p in PARTS.values())
    assert total <= BUDGET_S
    # the overhead bench runs the fleet and the redis-limit floor, one short phase each
    ovh = PARTS["overhead"]
    assert ovh.modes == ("fleet", "redis-limit") and not ovh.cuda
    assert ovh.estimate_s() == benches.BENCH_PROCESS_S + 2 * (15 + 2 + 10 + 1 + 10)


def test_a_plan_over_the_budget_is_refused() -> None:
    with pytest.raises(PlanError, match="over the 200 s budget"):
        plan(list(PARTS), budget_s=200)
    with pytest.raises(PlanError, match="unknown bench part"):
        plan(["overhead", "video"])
    # without CUDA the CUDA parts are skipped and count for nothing
    planned = plan(list(PARTS), budget_s=PARTS["overhead"].estimate_s(), device_checks=False,
                   cuda=False)  # fmt: skip
    assert [(p.name, skip) for p, skip in planned] == [
        ("overhead", None),
        ("text", "no CUDA device"),
        ("image", "no CUDA device"),
    ]


@pytest.mark.parametrize("name", list(PARTS))
def test_each_workload_is_the_shipped_one_cut_down(name: str) -> None:
    part = PARTS[name]
    data = tomllib.loads(workload_text(part))
    assert data["name"] == f"gpucheck-{name}" and data["repetitions"] == 1
    assert data["warmup_s"] == part.warmup_s
    assert [ph["duration_s"] for ph in data["phases"]] == [part.duration_s]
    if part.idle_s:
        assert data["accounting_idle_s"] == part.idle_s
    if name == "overhead":
        assert data["overrides"] == {"modalities.text.model": "identity"}
    w = parse_workload(data, origin=f"gpucheck-{name}")
    assert w.runnable


def test_cuda_parts_get_the_gpu_overlay_once() -> None:
    env = bench_env(PARTS["text"], {"PATH": "/bin"})
    assert env["FLEET_CONFIG"] == "configs/fleet.toml:configs/overlays/gpu.toml"
    again = bench_env(PARTS["image"], env)
    assert again["FLEET_CONFIG"] == env["FLEET_CONFIG"]
    assert "FLEET_CONFIG" not in bench_env(PARTS["overhead"], {"PATH": "/bin"})


def test_a_report_passes_when_every_mode_served_requests() -> None:
    report = {
        "modes": {"fleet": {"text": {"throughput_rps": 900.0}},
                  "redis-limit": {"text": {"throughput_rps": 20000.0}}},
        "cpu_us_per_request": {"fleet": {"producer": 100.0, "total": 1500.0}},
        "redis_cpu_us_per_request": {"fleet": 60.0},
        "accounting": {"fleet": {"redis_commands_per_request": 11.5}},
    }  # fmt: skip
    ok, figs, line = summarise(PARTS["overhead"], report)
    assert ok and figs["fleet_rps"] == 900.0 and figs["redis-limit_rps"] == 20000.0
    assert "fleet CPU 1,500 us/request" in line and "11.50 Redis commands" in line
    report["modes"]["redis-limit"]["text"]["throughput_rps"] = 0
    ok, _, line = summarise(PARTS["overhead"], report)
    assert not ok and "redis-limit served no text request" in line


def test_the_run_skips_a_part_that_no_longer_fits_before_the_deadline(tmp_path: Path) -> None:
    now = [0.0]
    ran: list[tuple[str, float]] = []

    def runner(part: BenchPart, out: Path, timeout_s: float) -> PartResult:
        ran.append((part.name, timeout_s))
        now[0] += part.estimate_s() * 2  # the first part runs slow
        return PartResult(part.title, True, {}, "ok")

    first, second = PARTS["overhead"], PARTS["text"]
    deadline = first.estimate_s() * 2 + second.estimate_s() - 1
    lines: list[str] = []
    results = run_parts([(first, None), (second, None), (PARTS["image"], "no CUDA device")],
                        deadline, tmp_path, out=lines.append, runner=runner,
                        clock=lambda: now[0])  # fmt: skip
    # the first part may run its estimate x SLACK, never past the deadline
    assert ran == [("overhead", first.estimate_s() * benches.SLACK)]
    assert [r.skipped for r in results] == [False, True, True]
    assert lines[0].startswith("gpu-check: [PASS] bench overhead")
    assert lines[1].startswith("gpu-check: [SKIP] bench text") and "budget left" in lines[1]
    assert "no CUDA device" in lines[2]


def test_cli_refuses_an_unknown_part() -> None:
    with pytest.raises(SystemExit):
        main(["--parts", "overhead,nope"])
