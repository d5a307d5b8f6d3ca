"""``fleet bench`` with the peers beside the fleet: the report carries their figures.

Runs only where the peer venv exists (``make peers``); CI's default install has no peers, so
there it is skipped with the reason the bench itself gives. No timing assertion: what is
checked is that each peer served the same requests through the same bench (every request
answered or coded) and that the report has the keys tooling reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from producer.tools.bench.peers import PEER_MODES, unavailable_reason

pytestmark = [pytest.mark.integration, pytest.mark.bench]
REPO = Path(__file__).resolve().parents[2]

WORKLOAD = """
name = "peers-smoke"
description = "text only: realtime, bulk, edge-case texts and HIGH requests that expire"
repetitions = 1
seed = 3
warmup_s = 0.5
drain_timeout_s = 60.0

[overrides]
"modalities.text.batching.max_batch_size" = 8
# HIGH requests expire before any worker takes them: each server must store that coded
# failure and still answer the expired request's batch-mates.
"priorities.high.timeout_s" = 0.001

[sources.text]
kind = "lines"
modality = "text"
path = "data/text/botchan_sentences.txt"

[sources.edge]
kind = "jsonl"
modality = "text"
path = "data/text/edge_cases.jsonl"
field = "text"

[[phases]]
name = "steady"
arrival = "poisson"
rate_rps = 20.0
count = 40
[[phases.mix]]
source = "text"
priority = "realtime"
weight = 1
[[phases.mix]]
source = "text"
priority = "bulk"
weight = 2
[[phases.mix]]
source = "edge"
priority = "normal"
weight = 1
[[phases.mix]]
source = "text"
priority = "high"
weight = 1
"""


@pytest.mark.timeout(900)
def test_peers_run_beside_the_fleet(tmp_path: Path) -> None:
    reasons = [r for r in (unavailable_reason(m) for m in PEER_MODES) if r]
    if reasons:
        pytest.skip("; ".join(reasons))
    workload = tmp_path / "peers-smoke.toml"
    workload.write_text(WORKLOAD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") or k == "FLEET_CONFIG"}
    if "FLEET_BENCH_PEERS_PYTHON" in os.environ:
        env["FLEET_BENCH_PEERS_PYTHON"] = os.environ["FLEET_BENCH_PEERS_PYTHON"]
    proc = subprocess.run(
        [sys.executable, "-m", "producer.cli", "bench", str(workload), "--modes",
         "fleet,celery-batches,ray-serve", "--out-dir", str(tmp_path / "out"),
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=840, env=env, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Peers" in proc.stdout
    r = json.loads((tmp_path / "out" / "latest.json").read_text())
    for mode in ("fleet", *PEER_MODES):
        assert r["modes"][mode]["text"]["throughput_rps"] > 0, mode
        out = r["outcomes"][mode]
        assert out["sent"] > 0
        # every request answered: a result or a code; an empty text is refused, not lost
        assert out["ok"] + sum(out["errors"].values()) == out["sent"], (mode, out)
        assert "NO_RESULT" not in out["errors"] and "SEND_FAILED" not in out["errors"], out
        assert set(out["errors"]) <= {"INVALID_INPUT", "DEADLINE_EXCEEDED"}, (mode, out)
        assert out["errors"].get("DEADLINE_EXCEEDED", 0) > 0, (mode, out)
        assert "realtime" in r["latency_ms"][mode]["text"]
    for peer in PEER_MODES:
        ratio = r["ratios"]["text"][f"fleet_over_{peer}"]
        assert ratio == pytest.approx(
            r["modes"]["fleet"]["text"]["throughput_rps"]
            / r["modes"][peer]["text"]["throughput_rps"]
        )
