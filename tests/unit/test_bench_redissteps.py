"""The per-step Redis figures of ``producer/tools/bench/redissteps.py``, without servers."""

from __future__ import annotations

from producer.tools.bench.redissteps import NESTED, STEPS, WRAPPERS, median_figures, step_figures


def test_a_script_step_splits_its_cost_into_its_commands_the_script_and_the_rest() -> None:
    """Two EVALSHA calls that ran 64 GETs between them: commandstats counts the GETs under
    their own name and inside EVALSHA's usec too, so the script's own share is EVALSHA less
    the GETs, and what lies outside the client's commands is the CPU less EVALSHA alone."""
    f = step_figures(
        calls={"evalsha": 2, "get": 64, "info": 2},
        usec={"evalsha": 320, "get": 64, "info": 90},
        cpu_s=0.000640,
        requests=64,
        wrappers={"evalsha"},
        nested={"get"},
    )
    assert f["cpu_us"] == 10.0  # 640 us over 64 requests
    assert f["commands"] == round(2 / 64, 3)  # the client sent two; INFO is the harness's
    assert f["in_scripts_beyond_commands_us"] == 4.0  # (320 - 64) / 64
    assert f["outside_commands_us"] == 5.0  # (640 - 320) / 64
    assert f["by_command"] == {"evalsha": 5.0, "get": 1.0}


def test_a_plain_pipeline_step_has_no_script_share() -> None:
    f = step_figures(
        calls={"zrem": 2, "hdel": 2}, usec={"zrem": 30, "hdel": 34}, cpu_s=0.000128, requests=64
    )
    assert f["commands"] == round(4 / 64, 3)
    assert f["in_scripts_beyond_commands_us"] == 0.0
    assert f["outside_commands_us"] == 1.0  # (128 - 64) / 64


def test_the_median_of_runs_is_taken_per_figure_and_per_command() -> None:
    runs = [
        {"cpu_us": c, "commands": 0.1, "in_scripts_beyond_commands_us": 1.0,
         "outside_commands_us": o, "by_command": by}
        for c, o, by in [
            (10.0, 3.0, {"evalsha": 5.0}),
            (30.0, 1.0, {"evalsha": 7.0, "get": 2.0}),
            (20.0, 2.0, {"evalsha": 6.0}),
        ]
    ]  # fmt: skip
    m = median_figures(runs)
    assert m["cpu_us"] == 20.0
    assert m["outside_commands_us"] == 2.0
    assert m["by_command"] == {"evalsha": 6.0, "get": 0.0}  # absent in two runs: 0 there


def test_every_step_names_its_wrappers_and_their_commands() -> None:
    assert set(WRAPPERS) == set(NESTED) == set(STEPS)
    for step in STEPS:
        assert not WRAPPERS[step] & NESTED[step]
        assert bool(NESTED[step]) == bool(WRAPPERS[step])  # nested commands need a wrapper
