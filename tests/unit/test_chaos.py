"""``producer.tools.chaos``'s pure parts: the report row, the goal's verdict, scenario files."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from producer.tools.chaos.faults import FAULTS, drill_faults, fault_named, parse_target
from producer.tools.chaos.ha import SCENARIOS as HA_SCENARIOS
from producer.tools.chaos.scenarios import ScenarioError, load_scenarios, select
from producer.tools.chaos.tally import Seen, row, verdict

OK = {"result": {"dim": 384}}
LATE = {"error": {"code": "DEADLINE_EXCEEDED", "message": "", "type": ""}}
KEYS = ("name", "sent", "completed", "lost", "duplicated_results", "duplicated_executions",
        "recover_s", "worker_exited")  # fmt: skip


def seen(n: int = 3, **kw: object) -> Seen:
    ids = [f"id-{i}" for i in range(n)]
    s = Seen(sent=ids, first=dict.fromkeys(ids, OK), last=dict.fromkeys(ids, OK))
    s.publishes = Counter(dict.fromkeys(ids, 1))
    s.executions = Counter(dict.fromkeys(ids, 1))
    s.fault_end_s, s.all_final_s = 100.0, 104.5
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def test_a_clean_scenario_has_the_reports_keys_and_meets_the_goal() -> None:
    r = row("x", seen())
    assert set(KEYS) <= set(r)
    assert (r["sent"], r["completed"], r["lost"], r["duplicated_results"]) == (3, 3, 0, 0)
    assert r["recover_s"] == 4.5 and r["states"] == {"SUCCESS": 3}
    assert verdict(r, 15.0) == []


def test_a_request_never_final_is_lost_and_there_is_no_recovery_time() -> None:
    s = seen()
    del s.last["id-1"]
    r = row("x", s)
    assert r["lost"] == 1 and r["completed"] == 2 and r["recover_s"] is None
    assert "1 lost" in verdict(r, 15.0)


def test_a_result_published_twice_or_changed_is_a_duplicated_result() -> None:
    s = seen(publishes=Counter({"id-0": 2, "id-1": 1, "id-2": 1}))
    s.last["id-2"] = LATE  # read SUCCESS first, DEADLINE_EXCEEDED at the end
    r = row("x", s)
    assert r["duplicated_results"] == 2
    assert "2 duplicated results" in verdict(r, 15.0)


def test_a_probe_in_a_state_the_scenario_forbids_misses_the_goal_the_load_does_not() -> None:
    s = seen(4)
    s.first["id-1"] = s.last["id-1"] = LATE  # the load's: a 0.2 s deadline, a busy machine
    s.probes = ["id-2", "id-3"]
    assert verdict(row("x", s, ["DEADLINE_EXCEEDED"]), 15.0) == []
    s.first["id-3"] = s.last["id-3"] = LATE  # a probe with a 30 s deadline: the fault's doing
    r = row("x", s, ["DEADLINE_EXCEEDED"])  # clock_skew
    assert r["unexpected_failures"] == 1
    assert verdict(r, 15.0) == ["1 probes in a state the fault must not cause"]
    assert row("x", s)["unexpected_failures"] == 0  # a scenario without fail_states


def test_a_second_run_alone_is_a_duplicated_execution_not_a_duplicated_result() -> None:
    r = row("x", seen(executions=Counter({"id-0": 2, "id-1": 1, "id-2": 1})))
    assert r["duplicated_executions"] == 1 and r["duplicated_results"] == 0
    assert verdict(r, 15.0) == []


def test_recovery_is_judged_without_the_worker_restart() -> None:
    s = seen()
    s.all_final_s = s.fault_end_s + 20.0
    s.restart_s = [8.0]
    assert verdict(row("x", s), 15.0) == []  # 20 s of which 8 s waiting for a restart
    s.restart_s = [2.0]
    assert verdict(row("x", s), 15.0) == ["recover_s 20.0 > 15.0"]


def test_an_exited_worker_misses_the_goal() -> None:
    assert verdict(row("x", seen(worker_exited=True)), 15.0) == ["a worker exited"]


def test_copies_of_an_id_count_once_as_sent() -> None:
    s = seen()
    s.sent = [*s.sent, "id-0"]
    assert row("x", s)["sent"] == 3


def test_the_shipped_scenario_file_covers_the_issue_and_short_runs_text_only() -> None:
    cf = load_scenarios()
    kinds = {s.fault for s in cf.scenarios}
    # every fault of the chaos drill has a scenario in the shipped file
    assert kinds == {n for n, f in FAULTS.items() if "chaos" in f.drills}
    assert {
        "sigkill",
        "sigstop",
        "sigterm",
        "redis_restart",
        "client_kill",
        "duplicates",
        "malformed",
        "results_refused",
        "results_halfway",
        "video_sigkill",
    } <= kinds
    short = select(cf, [], short=True, with_video=False)
    assert short and all(s.short and s.modality == "text" for s in short)
    assert len(select(cf, [], short=False, with_video=True)) == len(cf.scenarios)


def test_unknown_scenario_names_and_fields_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="unknown scenarios"):
        select(load_scenarios(), ["no-such"], short=False, with_video=True)
    bad = tmp_path / "c.toml"
    bad.write_text('[[scenarios]]\nname = "x"\nfault = "sigkill"\ntimes = 0\n')
    with pytest.raises(ScenarioError):
        load_scenarios(bad)
    bad.write_text('[[scenarios]]\nname = "x"\nfault = "meteor"\n')
    with pytest.raises(ScenarioError, match=r"unknown chaos fault 'meteor'.*sigkill, sigstop"):
        load_scenarios(bad)
    bad.write_text('[[scenarios]]\nname = "x"\nfault = "primary_sigkill"\n')
    with pytest.raises(ScenarioError, match="unknown chaos fault 'primary_sigkill'"):
        load_scenarios(bad)  # a fault of the HA drill


def test_every_fault_is_used_by_a_drill_and_the_ha_drill_runs_all_of_its_own() -> None:
    assert all(f.drills and f.ends for f in FAULTS.values())
    assert HA_SCENARIOS == ("sentinel_failover", "primary_sigkill")
    assert set(HA_SCENARIOS) == {n for n, f in FAULTS.items() if "ha" in f.drills}
    assert fault_named("primary_sigkill", "ha") is FAULTS["primary_sigkill"]
    with pytest.raises(ValueError, match="unknown ha fault 'sentinel_failvoer'"):
        drill_faults("ha", "sentinel_failvoer")


def test_targets_name_a_modality_and_an_instance() -> None:
    assert parse_target("worker-text") == ("text", 0)
    assert parse_target("worker-text-1") == ("text", 1)
    assert parse_target("worker-video") == ("video", 0)
