"""Pure logic of ``fleet bench submit-rate``: fresh message copies, summaries, ratios, the
table, and the workload that selects the runner."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from producer.tools.bench.submitrate_report import (
    counter_delta,
    fresh_copy,
    per_request,
    print_submit_rate_report,
    rate,
    ratio,
    ratios,
    summarize_path,
    verdict,
)
from producer.tools.bench.workload import load_workload, parse_workload

TASK_ID = "e6dba602-faa4-4947-8c9b-334c57551337"
TAG = "54ae24f6-0dc1-41ce-a5f7-f731c0c76c82"
MESSAGE = json.dumps(
    {
        "body": "W1tdLCB7fV0=",
        "headers": {"task": "fleet.text", "id": TASK_ID, "root_id": TASK_ID},
        "properties": {"correlation_id": TASK_ID, "priority": 9, "delivery_tag": TAG},
    }
).encode()


def test_fresh_copy_changes_only_the_ids() -> None:
    a, b = fresh_copy(MESSAGE), fresh_copy(MESSAGE)
    assert len(a) == len(MESSAGE) and a != b
    doc = json.loads(a)
    new_id = doc["headers"]["id"]
    assert new_id != TASK_ID and doc["headers"]["root_id"] == new_id
    assert doc["properties"]["correlation_id"] == new_id
    assert doc["properties"]["delivery_tag"] not in (TAG, new_id)
    assert TASK_ID.encode() not in a and TAG.encode() not in a
    back = a.replace(new_id.encode(), TASK_ID.encode()).replace(
        doc["properties"]["delivery_tag"].encode(), TAG.encode()
    )
    assert back == MESSAGE


@pytest.mark.parametrize("bad", [b"not json", b"{}", b'{"headers": {"id": "x"}}', b"[1]"])
def test_fresh_copy_refuses_what_is_not_a_task_message(bad: bytes) -> None:
    with pytest.raises(ValueError, match="not a kombu task message"):
        fresh_copy(bad)


def test_rate_and_ratio() -> None:
    assert rate(5000, 2.5) == 2000.0
    with pytest.raises(ValueError):
        rate(10, 0.0)
    assert ratio(1000.0, 4000.0) == 0.25
    assert ratio(1.0, 3.0) == 0.3333
    assert ratio(None, 1.0) is None and ratio(1.0, None) is None and ratio(1.0, 0.0) is None


def test_summarize_path_takes_the_median_of_rounds() -> None:
    rounds = [
        {"rps": 900.0, "cpu_us_per_request": 600.0},
        {"rps": 1100.0, "cpu_us_per_request": 500.0},
        {"rps": 1000.0, "cpu_us_per_request": 550.0},
    ]
    s = summarize_path(rounds)
    assert s["rps"] == 1000.0 and s["rps_spread"] == {"min": 900.0, "median": 1000.0, "max": 1100.0}
    assert s["cpu_us_per_request"] == 550.0 and s["rounds"] == rounds
    even = summarize_path([{"rps": 1.0}, {"rps": 2.0}])
    assert even["rps"] == 1.5 and even["cpu_us_per_request"] is None
    assert summarize_path([])["rps"] is None


def test_ratios_against_raw_and_the_verdict() -> None:
    paths = {
        "raw": {"rps": 100_000.0},
        "submit_many": {"rps": 50_000.0},
        "submit": {"rps": 2_000.0},
        "submit_many+wait": {"rps": 150.0},
    }
    r = ratios(paths)
    assert r == {
        "submit_many_over_raw": 0.5,
        "submit_over_raw": 0.02,
        "submit_many+wait_over_raw": 0.0015,
    }
    assert verdict(r["submit_many_over_raw"]) == {"target_submit_many_over_raw": 0.5, "met": True}
    assert verdict(0.49)["met"] is False and verdict(None)["met"] is None
    assert ratios({"submit_many": {"rps": 1.0}})["submit_many_over_raw"] is None


def test_command_counts_per_request() -> None:
    before = {"lpush": 10, "info": 3, "llen": 5}
    after = {"lpush": 210, "info": 4, "llen": 13, "publish": 200}
    delta = counter_delta(before, after)
    assert delta == {"lpush": 200, "info": 1, "llen": 8, "publish": 200}
    per = per_request(delta, 200, ignore=("info",))
    assert per == {"lpush": 1.0, "publish": 1.0, "llen": 0.04}
    assert list(per)[-1] == "llen"  # largest first
    assert per_request(delta, 0) == {}


def test_table_prints_every_path_and_the_ratios() -> None:
    paths = {
        name: summarize_path([{"rps": rps, "cpu_us_per_request": 10.0}])
        for name, rps in (("raw", 90_000.0), ("submit_many", 1_800.0), ("submit", 1_300.0),
                          ("submit_many+wait", 170.0))
    }  # fmt: skip
    rs = ratios(paths)
    report = {
        "repetitions": 1,
        "submit_rate": {
            "requests": 200,
            "chunk": 100,
            "message_bytes": 1554,
            "paths": paths,
            "ratios": rs,
            "verdict": verdict(rs["submit_many_over_raw"]),
            "commands_per_request": {"raw": {"lpush": 1.0}},
        },
        "warnings": ["1 round(s): medians need at least 3"],
    }
    out = io.StringIO()
    print_submit_rate_report(report, Console(file=out, width=150))
    text = out.getvalue()
    for name in ("raw", "submit_many", "submit", "submit_many+wait", "lpush 1"):
        assert name in text
    assert "submit_many / raw = 0.020 (target >= 0.5: not met)" in text
    assert "1 round(s)" in text


def test_the_shipped_workload_selects_the_runner() -> None:
    w = load_workload("submit-rate")
    assert w.runner == "submit-rate" and w.repetitions >= 3
    assert [p.count for p in w.phases] == [5000]
    assert {m.priority for p in w.phases for m in p.mix} == {"bulk"}
    assert load_workload("smoke").runner == "modes"
    with pytest.raises(ValueError, match="runner"):
        parse_workload({**w.model_dump(mode="json"), "runner": "other"})
