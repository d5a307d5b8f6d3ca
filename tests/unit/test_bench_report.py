"""The bench report's schema, built from synthetic records (no stack, no timing)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from producer.tools.bench.collector import batch_size_of, outcome_of, parse_date_done_ms
from producer.tools.bench.records import NO_RESULT, Record
from producer.tools.bench.report import build_report, write_report
from producer.tools.bench.runner import BenchResult, ModeResult
from producer.tools.bench.stats import summarize_rep
from producer.tools.bench.tables import print_report
from producer.tools.bench.workload import load_workload

PRIOS = ("realtime", "high", "normal", "bulk")


def records(rep: int, slow: float) -> list[Record]:
    out = []
    for i in range(80):
        modality = "text" if i % 3 else "image"
        prio = PRIOS[i % 4]
        sched = 1000.0 + 25.0 * i
        r = Record(
            id=f"{rep}-{i}",
            rep=rep,
            phase="steady",
            modality=modality,
            priority=prio,
            source=modality,
            input_index=i,
            measured=i >= 4,
            timeout_s={"realtime": 0.2, "high": 1.0, "normal": 2.0}.get(prio),
            sched_ms=sched,
            sent_ms=sched + 0.3,
        )
        if i == 7:
            r.ok, r.code, r.done_ms = False, "INVALID_INPUT", sched + 5
        elif i == 11:
            r.ok, r.code, r.done_ms = False, NO_RESULT, sched + 60_000
        else:
            r.ok, r.done_ms = True, sched + slow * (1 + i % 5)
            r.started_ms, r.compute_ms, r.batch_size = sched + 2, 8.0, 1 + i % 4
        out.append(r)
    return out


def result() -> BenchResult:
    w = load_workload("smoke")
    res = BenchResult(w, 3, "2026-01-02T03:04:05.678+00:00", "2026-01-02T03:06:00+00:00")
    res.duration_s = 115.0
    res.settings_facts = {
        m: {"model": m, "device": "cpu", "torch_threads": 1, "prefetch_multiplier": 16,
            "max_batch_size": 8, "max_queue_delay_ms": 2.0}
        for m in ("text", "image")
    }  # fmt: skip
    res.load_avg_start = (0.1, 0.1, 0.1)
    res.load_avg_end = (0.5, 0.3, 0.2)
    for mode, slow in (("fleet", 20.0), ("baseline", 60.0)):
        mr = ModeResult(mode)
        for rep in range(3):
            recs = records(rep, slow + rep)
            mr.reps.append(recs)
            mr.summaries.append(summarize_rep(recs))
        mr.cold = {m: {"ready_s": 12.0, "first_ms": 90.0, "warm_idle_ms": 30.0}
                   for m in ("text", "image")}  # fmt: skip
        mr.workers = {m: {"runtime": {"device": "cpu", "torch_threads": 1, "warmup_s": 3.0}}
                      for m in ("text", "image")}  # fmt: skip
        res.modes[mode] = mr
    res.limit = {
        m: {"throughput_reps": [100.0, 110.0, 105.0], "best_batch_size": 16,
            "sweep_rps": {"1": 50.0, "16": 105.0}, "unsorted_rps": 60.0, "inputs": 50,
            "errors": 0, "load_s": 2.0, "torch_threads": 1, "device": "cpu"}
        for m in ("text", "image")
    }  # fmt: skip
    return res


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return build_report(result())


def test_report_has_the_issue_schema(report: dict[str, Any]) -> None:
    assert report["workload"] == "smoke" and report["repetitions"] == 3
    m = report["machine"]
    assert {"cores", "torch_threads", "device", "versions"} <= set(m)
    assert m["torch_threads"] == {"text": 1, "image": 1}
    assert {"python", "torch", "celery"} <= set(m["versions"])
    for mode in ("fleet", "baseline", "limit"):
        for modality in ("text", "image"):
            assert isinstance(report["modes"][mode][modality]["throughput_rps"], float)
    for mode in ("fleet", "baseline"):
        for modality in ("text", "image"):
            for prio in PRIOS:
                lat = report["latency_ms"][mode][modality][prio]
                assert {"p50", "p95", "p99", "max"} <= set(lat)
                assert lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"]
                frac = report["deadline_misses"][mode][modality][prio]
                assert 0.0 <= frac <= 1.0
            assert report["overhead_ms"][mode][modality] is not None
            assert "steady_p50_ms" in report["cold_start"][mode][modality]
            assert "first_ms" in report["cold_start"][mode][modality]
    for modality in ("text", "image"):
        r = report["ratios"][modality]
        assert set(r) == {"fleet_over_baseline", "fleet_over_limit"}
        assert r["fleet_over_limit"] == pytest.approx(
            report["modes"]["fleet"][modality]["throughput_rps"] / 105.0
        )
    json.dumps(report)  # JSON-serializable as built


def test_model_busy_is_the_model_time_share_of_each_repetition() -> None:
    from producer.tools.bench.workerstats import add_stats_diff

    mr = ModeResult("fleet")
    stats = {"text": {"model_s": 10.0, "batch_sizes": {"8": 5}}}
    # 16 s of model time in a 20 s repetition, then 9 s in 10 s; a baseline-like worker
    # without the counter contributes nothing
    add_stats_diff(mr, stats, {"text": {"model_s": 26.0, "batch_sizes": {"8": 9}}}, 20.0)
    add_stats_diff(mr, {"text": {"model_s": 26.0}}, {"text": {"model_s": 35.0}}, 10.0)
    add_stats_diff(mr, {}, {"image": {"batch_sizes": {"1": 3}}}, 10.0)
    assert mr.model_busy == {"text": [0.8, 0.9]}
    assert mr.batches["text"] == {8: 4}


def test_cdf_series_cover_all_measured_requests(report: dict[str, Any]) -> None:
    text_rt = report["cdf_ms"]["fleet"]["text"]["realtime"]
    assert text_rt["values"] == sorted(text_rt["values"])
    assert text_rt["ok"] == len(text_rt["values"]) <= text_rt["requests"]
    assert text_rt["requests"] == report["latency_ms"]["fleet"]["text"]["realtime"]["n"] + sum(
        1 for rep in range(3) for r in records(rep, 1.0)
        if r.measured and r.modality == "text" and r.priority == "realtime" and not r.ok
    )  # fmt: skip


def test_report_counts_errors_and_missing_results(report: dict[str, Any]) -> None:
    # i=7 (INVALID_INPUT) is text; i=11 (NO_RESULT) is text; 3 repetitions each.
    assert report["errors"]["fleet"]["text"] == {"INVALID_INPUT": 3, NO_RESULT: 3}
    assert report["requests"]["fleet"]["text"]["no_result"] == 3
    assert any("got no result" in w for w in report["warnings"])
    assert report["batch_sizes"]["baseline"]["text"]["batches"] == {
        "1": report["requests"]["baseline"]["text"]["ok"]
    }


def test_write_and_print(report: dict[str, Any], tmp_path: Path) -> None:
    files = write_report(dict(report), tmp_path, plot=True)
    saved = json.loads(Path(files["json"]).read_text())
    assert Path(files["json"]).name == "smoke-20260102T030405Z.json"
    assert json.loads((tmp_path / "latest.json").read_text()) == saved
    assert Path(files["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    buf = io.StringIO()
    print_report(saved, Console(file=buf, width=160))
    text = buf.getvalue()
    assert "Throughput" in text and "realtime" in text and "latest" in text


def test_result_parsing_helpers() -> None:
    ok = {"status": "SUCCESS", "result": {"dim": 384}, "date_done": "2026-01-01T00:00:01+00:00"}
    assert outcome_of(ok) == (1767225601000.0, True, None)
    failed = {
        "status": "FAILURE",
        "result": {"exc_type": "DeadlineExceeded", "exc_message": ["late", "DEADLINE_EXCEEDED"],
                   "exc_module": "shared.errors"},
        "date_done": "2026-01-01T00:00:01.5+00:00",
    }  # fmt: skip
    assert outcome_of(failed) == (1767225601500.0, False, "DEADLINE_EXCEEDED")
    assert outcome_of({"status": "PROGRESS", "result": {}}) is None
    assert parse_date_done_ms(None) is None
    assert batch_size_of("{'batch_id': 'vm-1-2', 'batch_size': 7}") == 7
    assert batch_size_of("None") is None and batch_size_of(None) is None


def test_the_plot_draws_every_peer_without_a_warning(tmp_path: Path) -> None:
    """Each mode's CDF line style (the ray-serve one is a dash tuple) reaches matplotlib as
    a style, not as data: the plot used to fail whenever ray-serve ran."""
    res = result()
    for mode, slow in (("celery-batches", 40.0), ("ray-serve", 80.0)):
        mr = ModeResult(mode)
        for rep in range(3):
            recs = records(rep, slow)
            mr.reps.append(recs)
            mr.summaries.append(summarize_rep(recs))
        res.modes[mode] = mr
    rep = build_report(res)
    assert {"celery-batches", "ray-serve"} <= set(rep["cdf_ms"])
    files = write_report(rep, tmp_path, plot=True)
    assert not [w for w in rep.get("warnings", []) if "plot" in w]
    assert Path(files["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
