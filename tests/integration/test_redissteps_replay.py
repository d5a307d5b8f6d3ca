"""``python -m producer.tools.bench.redissteps`` on a Redis of its own: every step of a
request's Redis path replayed with the product's code, and each step's figures from the
server's own counters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from producer.tools.bench.redissteps import STEPS, main, measure

pytestmark = [pytest.mark.integration, pytest.mark.bench]


def test_every_step_is_replayed_and_accounted(tmp_path: Path) -> None:
    """256 requests in batches of 32, takes of 63: every step served them all (the tool
    raises otherwise: a message not taken, a result not written or not read), and each
    step's commands are the ones its code sends."""
    r = measure(256, 32, 63, 1, tmp_path, subscriber=True)
    assert set(r["steps"]) == set(STEPS)
    assert r["message_bytes"] > 500  # Celery's message: headers, properties, base64 body
    steps = r["steps"]
    for step in STEPS:
        assert steps[step]["cpu_us"] > 0
    # the final write: one script call per batch, four commands per request inside it
    assert steps["write"]["commands"] == pytest.approx(1 / 32, abs=0.002)
    assert {"evalsha", "setex", "set", "publish"} <= set(steps["write"]["by_command"])
    # the take: RPOP with a count per priority list, one HSET and one ZADD per call
    assert {"evalsha", "rpop", "hset", "zadd"} <= set(steps["take"]["by_command"])
    assert set(steps["ack"]["by_command"]) == {"zrem", "hdel"}
    assert steps["ack"]["in_scripts_beyond_commands_us"] == 0.0
    assert set(steps["read"]["by_command"]) == {"mget"}


def test_the_command_line_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "steps.json"
    assert main(["--requests", "64", "--repeats", "1", "--no-aof", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["aof"] is False and report["requests"] == 64
    assert report["total_cpu_us"] == pytest.approx(
        sum(s["cpu_us"] for s in report["steps"].values()), abs=0.05
    )
