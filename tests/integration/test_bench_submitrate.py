"""``fleet bench submit-rate`` end to end, small: its own Redis and text worker, every path.

No rate assertion (this machine's numbers are noise): the run completes, the report has the
documented structure, every path put exactly N messages into Redis (the bench counts the
priority lists after each path and fails otherwise; the report keeps the counts), and with a
worker every request's result arrived.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.bench]
REPO = Path(__file__).resolve().parents[2]
N = 200


def _small_workload(tmp_path: Path) -> Path:
    """The shipped workload with N requests, one round, and a worker that warms up quickly."""
    text = (REPO / "configs" / "workloads" / "submit-rate.toml").read_text()
    text = text.replace("count = 5000", f"count = {N}").replace(
        "repetitions = 3", "repetitions = 1"
    )
    text = text.replace(
        "[sources.text]",
        '[overrides]\n"modalities.text.batching.max_batch_size" = 16\n\n[sources.text]',
    )
    assert tomllib.loads(text)["phases"][0]["count"] == N
    path = tmp_path / "submit-rate.toml"
    path.write_text(text)
    return path


@pytest.mark.timeout(400)
def test_submit_rate_small(tmp_path: Path) -> None:
    # The bench picks its own ports and run dir; drop the test stack's FLEET_* settings.
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") or k == "FLEET_CONFIG"}
    proc = subprocess.run(
        [sys.executable, "-m", "producer.cli", "bench", str(_small_workload(tmp_path)),
         "--out-dir", str(tmp_path / "out"), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=380, env=env, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Producer submit rate" in proc.stdout and "submit_many / raw" in proc.stdout

    latest = json.loads((tmp_path / "out" / "latest.json").read_text())
    stamped = list((tmp_path / "out").glob("submit-rate-*.json"))
    assert len(stamped) == 1 and json.loads(stamped[0].read_text()) == latest
    assert re.fullmatch(r"submit-rate-\d{8}T\d{6}Z\.json", stamped[0].name)

    r = latest
    assert r["workload"] == "submit-rate" and r["repetitions"] == 1
    assert {"cores", "load_avg_start", "load_avg_end"} <= set(r["machine"])
    sr = r["submit_rate"]
    assert sr["requests"] == N and sr["chunk"] == 100 and sr["message_bytes"] > 500
    assert sr["list_keys"] == ["text\x06\x169"]  # BULK: Celery priority 9 of the text queue
    assert set(sr["paths"]) == {"raw", "submit_many", "submit", "submit_many+wait"}
    for name, path in sr["paths"].items():
        assert path["rps"] > 0 and len(path["rounds"]) == 1, name
        assert path["rps_spread"]["min"] <= path["rps"] <= path["rps_spread"]["max"]
    for name in ("raw", "submit_many", "submit"):
        assert sr["paths"][name]["rounds"][0]["enqueued"] == N, name
    waited = sr["paths"]["submit_many+wait"]["rounds"][0]
    assert waited["results"] == N and waited["ok"] == N and waited["errors"] == {}
    assert set(sr["ratios"]) == {
        "submit_many_over_raw", "submit_over_raw", "submit_many+wait_over_raw"
    }  # fmt: skip
    assert sr["ratios"]["submit_many_over_raw"] == pytest.approx(
        sr["paths"]["submit_many"]["rps"] / sr["paths"]["raw"]["rps"], abs=1e-4
    )
    assert sr["verdict"]["target_submit_many_over_raw"] == 0.5
    # raw: one LPUSH per request; the client's paths: one transaction per call, holding one
    # LPUSH per list (all BULK text here: one list) and one PUBLISH of the call's task-sent
    # events (one group message)
    cmds = sr["commands_per_request"]
    assert cmds["raw"] == {"lpush": 1.0}
    assert cmds["submit"]["lpush"] == cmds["submit"]["exec"] == cmds["submit"]["publish"] == 1.0
    for command in ("lpush", "exec", "publish"):
        assert cmds["submit_many"][command] == pytest.approx(1 / sr["chunk"]), command
    assert any("1 round(s)" in w for w in r["warnings"])
