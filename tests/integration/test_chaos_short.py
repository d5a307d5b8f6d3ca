"""``fleet chaos --short`` (CI's version of ``make chaos``): real faults on a real stack of
its own (Redis + two text workers + an image worker) under steady load, each request's
final state counted. The goal as the issue states it: 0 lost, 0 duplicated final results,
every request final within 15 s of the fault's end (worker restarts not counted), no worker
exit. ``worker_sigkill_x3`` is left to ``make chaos`` (see the README: a message in the
BRPOP reply when its worker is killed is lost; known, open).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from producer.tools.chaos.runner import RECOVER_LIMIT_S, Options, misses, run
from producer.tools.chaos.scenarios import load_scenarios, select

pytestmark = pytest.mark.integration

SHORT_OK = [
    "redis_restart",
    "client_kill",
    "duplicate_publishes_50",
    "malformed_bodies_20",
    "results_refused_5s",
    "results_refused_halfway_6s",
]


@pytest.mark.timeout(900)
def test_short_chaos_loses_nothing_and_never_shows_two_results(tmp_path: Path) -> None:
    cf = load_scenarios()
    chosen = select(cf, SHORT_OK, short=True, with_video=False)
    out = tmp_path / "chaos.json"
    report = run(Options(chosen, cf.load, with_video=False, out=out))
    assert json.loads(out.read_text()) == report
    rows = {r["name"]: r for r in report["scenarios"]}
    assert list(rows) == SHORT_OK
    for r in rows.values():
        print(json.dumps({k: r[k] for k in r if k != "lost_ids"}))
        assert r["sent"] > 0 and r["completed"] == r["sent"], r
    assert rows["malformed_bodies_20"]["states"].get("INVALID_MESSAGE") == 20
    assert misses(report) == {}, (misses(report), RECOVER_LIMIT_S)
