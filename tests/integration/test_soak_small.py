"""``fleet soak`` on a small count: its own stack, every request succeeds, a well-formed report.

Memory growth is a benchmark figure (``make soak``), not asserted here: a 300-request run on a
shared 2-core machine says nothing about a 10,000-request one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from producer.tools.soak import (
    Soak,
    SoakError,
    SoakOptions,
    growth_pct,
    load_sentences,
    read_rss_mb,
    summary,
    waves_of,
    write_report,
)
from shared.procs import running

REPO = Path(__file__).resolve().parents[2]

REPORT_KEYS = {
    "requests",
    "succeeded",
    "errors",
    "error_codes",
    "timeouts",
    "warmup_requests",
    "warmup_errors",
    "wave_size",
    "waves",
    "rss_mb_start",
    "rss_mb_end",
    "rss_mb_max",
    "rss_growth_pct",
    "rss_samples",
    "cuda_reserved_mb_start",
    "cuda_reserved_mb_end",
    "duration_s",
    "throughput_rps",
    "worker",
}


# -- helpers (no stack) ---------------------------------------------------------------------
def test_waves_split_the_count() -> None:
    assert waves_of(10_000, 500) == [500] * 20
    assert waves_of(1_050, 500) == [500, 500, 50]
    assert waves_of(300, 1_000) == [300]
    assert waves_of(0, 500) == []


def test_growth_and_rss_of_this_process() -> None:
    assert growth_pct(100.0, 104.0) == pytest.approx(4.0)
    assert growth_pct(0.0, 5.0) == 0.0
    assert 1.0 < read_rss_mb(os.getpid()) < 100_000.0
    with pytest.raises(SoakError):
        read_rss_mb(2**22 + 12345)  # above the kernel's default pid_max: never a process


def test_sentences_are_real_lines() -> None:
    sents = load_sentences()
    assert len(sents) > 1000
    assert all(s.strip() == s and len(s) >= 3 for s in sents)


def test_bad_options_are_refused() -> None:
    with pytest.raises(SoakError):
        Soak(SoakOptions(requests=0))


# -- a real run -----------------------------------------------------------------------------
@pytest.mark.integration
def test_small_soak_on_its_own_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Smaller batches keep the worker's warmup short; batching is still exercised.
    monkeypatch.setenv("FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE", "16")
    run_dir = tmp_path / "run"
    before = dict(os.environ)
    report = Soak(
        SoakOptions(requests=300, warmup=60, wave=100, out=None, run_dir=run_dir),
        log=lambda _msg: None,
    ).run()
    assert dict(os.environ) == before  # the soak's FLEET_* variables were restored

    assert not REPORT_KEYS - set(report), REPORT_KEYS - set(report)
    assert report["requests"] == 300 and report["succeeded"] == 300
    assert report["errors"] == 0 and report["error_codes"] == {} and report["timeouts"] == 0
    assert report["warmup_requests"] == 60 and report["warmup_errors"] == 0
    assert report["waves"] == 3 and report["wave_size"] == 100
    samples = report["rss_samples"]
    assert [s["requests_done"] for s in samples] == [0, 100, 200, 300]
    assert all(s["rss_mb"] > 0 for s in samples)
    assert report["rss_mb_start"] == samples[0]["rss_mb"]
    assert report["rss_mb_end"] == samples[-1]["rss_mb"]
    assert report["rss_mb_max"] == max(s["rss_mb"] for s in samples)
    assert isinstance(report["rss_growth_pct"], float)
    assert report["duration_s"] > 0 and report["throughput_rps"] > 0
    # CPU here: no CUDA figures; on a GPU worker they would be numbers.
    if report["worker"]["device"] == "cpu":
        assert report["cuda_reserved_mb_start"] is None
        assert report["cuda_reserved_mb_end"] is None
    w = report["worker"]
    assert w["cmdline_is_celery_worker"] is True  # `fleet worker` execs Celery: the pid is it
    assert w["child_processes"] == 0  # solo pool: inference runs in the measured process
    assert w["succeeded_delta"] == 300 and w["failed_delta"] == 0

    # The stack is gone: no pidfiles left, the worker's process has exited.
    assert not list((run_dir / "pids").glob("*.pid"))
    assert not running(w["pid"])

    out = tmp_path / "soak.json"
    write_report(report, out)
    assert json.loads(out.read_text())["requests"] == 300
    assert "300 requests" in summary(report)


def test_soak_command_line_help() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "producer.cli", "soak", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--requests" in proc.stdout and "--wave" in proc.stdout
