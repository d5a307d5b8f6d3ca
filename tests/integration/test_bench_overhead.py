"""``fleet bench`` with CPU accounting on the identity model, short: the fleet and the
redis-limit mode, one repetition of a 3 s closed loop (the shipped ``overhead-saturate``
with its phases cut down). Checks the report's accounting keys, not the numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.bench]
REPO = Path(__file__).resolve().parents[2]


def _short_workload(path: Path) -> Path:
    text = (REPO / "configs/workloads/overhead-saturate.toml").read_text()
    w = tomllib.loads(text)
    assert w["overrides"] == {"modalities.text.model": "identity"}
    out = path / "ovh-short.toml"
    out.write_text(
        text.replace('name = "overhead-saturate"', 'name = "ovh-short"')
        .replace("warmup_s = 3.0", "warmup_s = 1.0")
        .replace("accounting_idle_s = 3.0", "accounting_idle_s = 0.5")
        .replace("concurrency = 2000", "concurrency = 500")
        .replace("duration_s = 15.0", "duration_s = 3.0")
    )
    return out


@pytest.mark.timeout(180)
def test_overhead_accounting_report(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") or k == "FLEET_CONFIG"}
    proc = subprocess.run(
        [sys.executable, "-m", "producer.cli", "bench", str(_short_workload(tmp_path)),
         "--repetitions", "1", "--modes", "fleet,limit,redis-limit", "--no-plot",
         "--out-dir", str(tmp_path), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=170, env=env, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Cost per request" in proc.stdout
    r = json.loads((tmp_path / "latest.json").read_text())
    assert "limit" not in r["modes"]  # skipped for the identity model, with its reason
    assert any(n.startswith("skipped limit:") for n in r["warnings"])
    assert r["modes"]["fleet"]["text"]["throughput_rps"] > 0
    assert r["modes"]["redis-limit"]["text"]["throughput_rps"] > 0
    for mode in ("fleet", "redis-limit"):
        cpu = r["cpu_us_per_request"][mode]
        assert cpu["producer"] > 0 and cpu["total"] > 0
        assert r["redis_cpu_us_per_request"][mode] > 0
        assert r["accounting"][mode]["redis_usec_by_command"]
    assert r["cpu_us_per_request"]["fleet"]["worker"] > 0
    assert r["accounting"]["fleet"]["redis_commands_per_request"] > 1
    assert "lpush" in r["accounting"]["redis-limit"]["redis_calls_by_command"]
    # outside its commands: every message's bytes cross a socket at least twice (pushed,
    # popped); the fleet's results reach the bench's pattern subscriber
    for mode in ("fleet", "redis-limit"):
        io = r["accounting"][mode]["redis_io_per_request"]
        assert io["net_in_bytes"] > 500 and io["net_out_bytes"] > 500, mode
        assert 0 < io["kernel_share"] < 1 and io["socket_reads"] > 0, mode
    assert r["accounting"]["fleet"]["redis_io_per_request"]["pubsub_clients"] >= 1
