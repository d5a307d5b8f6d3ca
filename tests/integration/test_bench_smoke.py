"""``fleet bench smoke`` end to end: its own Redis and workers, every mode, a full report.

No timing assertion: this machine's numbers are noise. What is checked is that the run
completes, the report has the documented structure, and every request came back with a
result or a coded error.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.bench]
REPO = Path(__file__).resolve().parents[2]
PRIOS = ("realtime", "high", "normal", "bulk")


@pytest.mark.timeout(600)
def test_bench_smoke_report(tmp_path: Path) -> None:
    # The bench picks its own ports and run dir; drop the test stack's FLEET_* settings.
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") or k == "FLEET_CONFIG"}
    proc = subprocess.run(
        [sys.executable, "-m", "producer.cli", "bench", "smoke", "--repetitions", "2",
         "--out-dir", str(tmp_path), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=540, env=env, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Throughput" in proc.stdout and "Latency" in proc.stdout

    latest = json.loads((tmp_path / "latest.json").read_text())
    stamped = [p for p in tmp_path.glob("smoke-*.json")]
    assert len(stamped) == 1 and json.loads(stamped[0].read_text()) == latest
    assert re.fullmatch(r"smoke-\d{8}T\d{6}Z\.json", stamped[0].name)
    assert (tmp_path / "latest.png").read_bytes()[:4] == b"\x89PNG"

    r = latest
    # Two repetitions (make bench runs three): enough to check the interleaved order rotates.
    assert r["workload"] == "smoke" and r["repetitions"] == 2
    assert {"cores", "torch_threads", "device", "versions"} <= set(r["machine"])
    for mode in ("fleet", "baseline", "limit"):
        for m in ("text", "image"):
            assert r["modes"][mode][m]["throughput_rps"] > 0
    for mode in ("fleet", "baseline"):
        for m in ("text", "image"):
            for p in PRIOS:
                assert {"p50", "p95", "p99", "max"} <= set(r["latency_ms"][mode][m][p])
                assert 0.0 <= r["deadline_misses"][mode][m][p] <= 1.0
            assert r["cold_start"][mode][m]["first_ms"] is not None
    # Interleaved (the default): each repetition runs every mode, the order rotated by one.
    n = r["repetitions"]
    assert r["method"]["order"] == "interleaved"
    assert r["order"] == [["fleet", "baseline", "limit"], ["baseline", "limit", "fleet"],
                          ["limit", "fleet", "baseline"]][:n]  # fmt: skip
    for m in ("text", "image"):
        ratios = r["ratios"][m]
        assert set(ratios) == {"fleet_over_baseline", "fleet_over_limit", "by_repetition"}
        for mode in ("baseline", "limit"):
            reps = [r["modes"][x][m]["throughput_reps"] for x in ("fleet", mode)]
            assert len(reps[0]) == len(reps[1]) == n
            paired = ratios["by_repetition"][f"fleet_over_{mode}"]
            assert paired == pytest.approx([a / b for a, b in zip(*reps, strict=True)])

    # Every request got a result or a coded error (smoke sends a few invalid texts on purpose).
    for mode in ("fleet", "baseline"):
        out = r["outcomes"][mode]
        assert out["sent"] > 0
        assert out["ok"] + sum(out["errors"].values()) == out["sent"]
        assert "NO_RESULT" not in out["errors"] and "SEND_FAILED" not in out["errors"]
        assert all(re.fullmatch(r"[A-Z_]+", code) for code in out["errors"])
        assert out["errors"].get("INVALID_INPUT", 0) > 0  # the edge-case inputs


@pytest.mark.timeout(600)
def test_bench_gateway_mode(tmp_path: Path) -> None:
    """``--modes gateway``: the smoke schedule POSTed through ``fleet gateway``. The smoke
    workload's refused edge cases and its first texts must not break the idle-overhead probes
    (they once took an empty text and a 1 s HIGH deadline and aborted the run)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") or k == "FLEET_CONFIG"}
    proc = subprocess.run(
        [sys.executable, "-m", "producer.cli", "bench", "smoke", "--modes", "gateway",
         "--repetitions", "1", "--no-plot", "--out-dir", str(tmp_path),
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=540, env=env, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "latest.json").read_text())
    idle = r["gateway"]["idle_overhead"]
    assert idle["n"] == 40 and idle["gateway_p50_ms"] > 0 and idle["direct_p50_ms"] > 0
    out = r["outcomes"]["gateway"]
    assert out["sent"] > 0 and out["ok"] > 0
    assert out["ok"] + sum(out["errors"].values()) == out["sent"], out
    assert "NO_RESULT" not in out["errors"] and "SEND_FAILED" not in out["errors"], out
    # smoke's edge cases reach the gateway and are refused there with the schema's code
    assert out["errors"].get("INVALID_INPUT", 0) > 0, out


@pytest.mark.timeout(300)
def test_metrics_cost_round_switches_real_workers(tmp_path: Path) -> None:
    """One short round of ``--metrics-cost``: the on worker records and serves its metrics and
    traces, the off worker (same port configured) serves nothing and traces nothing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") or k == "FLEET_CONFIG"}
    proc = subprocess.run(
        [sys.executable, "-m", "producer.cli", "bench", "text-saturate", "--metrics-cost",
         "--cost-rounds", "1", "--cost-round-s", "5", "--out-dir", str(tmp_path),
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=280, env=env, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Metrics and tracing cost" in proc.stdout and "metrics cost (text)" in proc.stdout

    r = json.loads((tmp_path / "latest.json").read_text())
    mc = r["metrics_cost"]
    assert set(r["modes"]) == {"metrics-on", "metrics-off"}
    assert mc["order"] == ["on", "off"] and mc["rounds"] == 1
    assert len(mc["on"]) == len(mc["off"]) == 1 and mc["on"][0] > 0 and mc["off"][0] > 0
    assert mc["cost_pct"] == pytest.approx((mc["off"][0] - mc["on"][0]) / mc["off"][0] * 100)
    on, off = sorted(mc["checks"], key=lambda c: c["variant"] != "on")
    assert (on["metrics_enabled"], on["tracing"], on["metrics_served"]) == (True, True, True)
    assert (off["metrics_enabled"], off["tracing"], off["metrics_served"]) == (False,) * 3
    # The on worker counted every success of its round (plus the bench's probes: 1 + 5).
    ok = r["outcomes"]["metrics-on"]["ok"]
    assert ok <= on["metrics_requests_ok"] <= ok + 6
    assert off["metrics_requests_ok"] is None
