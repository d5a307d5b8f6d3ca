"""Redis failover on a real local Sentinel setup (CI's version of ``make ha-check``): a
primary, a replica and three sentinels, two text workers with the real model, 300 requests
in flight per scenario; ``SENTINEL FAILOVER`` and, separately, SIGKILL of the primary. Every
request must end with exactly one final result, and requests must complete again on the
new primary within 15 s of the fault.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from producer.chaos.ha import RECOVER_LIMIT_S, SCENARIOS, HaOptions, misses_of, run

pytestmark = pytest.mark.integration


@pytest.mark.timeout(900)
def test_every_request_ends_with_one_result_through_both_failovers(tmp_path: Path) -> None:
    out = tmp_path / "ha.json"
    report = run(HaOptions(requests=300, out=out, settle_timeout_s=120.0))
    assert json.loads(out.read_text()) == report
    rows = {r["name"]: r for r in report["scenarios"]}
    assert list(rows) == list(SCENARIOS)
    for r in rows.values():
        print(json.dumps({k: r[k] for k in r if k != "lost_ids"}))
        assert r["sent"] == 300, r
        assert r["primary_after"] and r["primary_after"] != r["primary_before"], r  # it failed over
        assert r["states"] == {"SUCCESS": 300}, r
        assert misses_of(r) == [], (r, RECOVER_LIMIT_S)
        assert not r["worker_exited"], r
