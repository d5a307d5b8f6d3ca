"""What a tenant's ``max_queued`` costs Redis per request: ``INFO commandstats`` deltas.

``python -m producer.tools.bench.tenantcost [N]`` starts a Redis and one text worker of its own
(the bench's environment, ``.run/bench/tenant-cost-<time>``), then for each kind of request,
N of them (default 3,000; BULK texts, ``submit_many``):

- ``none``: no tenant (the default tenant, no limit);
- ``free``: a tenant of ``[tenants]`` with a weight and no ``max_queued``;
- ``limited``: a tenant with ``max_queued`` (larger than N: nothing refused).

it counts Redis' commands (``INFO commandstats`` calls, the harness's own ``INFO`` left out)
over the submit alone, and over submit + every result (the worker's takes, result writes,
acks and their releases), per request. Prints one JSON object.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from datetime import UTC, datetime
from typing import Any

from producer.client import FleetClient, SubmitRequest
from producer.tools.bench.workload import REPO, Workload
from shared.redis_client import redis_client
from shared.settings import load_settings

KINDS = {"none": None, "free": "free", "limited": "limited"}
HARNESS = ("info",)


def calls(admin: Any) -> dict[str, int]:
    stats = admin.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def delta(before: dict[str, int], after: dict[str, int], n: int) -> dict[str, float]:
    """Commands per request, by command (those that changed), and their total."""
    out = {
        k: round((after.get(k, 0) - before.get(k, 0)) / n, 3)
        for k in sorted(after)
        if k not in HARNESS and after.get(k, 0) != before.get(k, 0)
    }
    out["total"] = round(sum(out.values()), 3)
    return out


def main(n: int = 3000) -> dict[str, Any]:
    from producer.stack.local import Stack
    from producer.tools.bench.runner import bench_environment

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    run_dir = REPO / ".run" / "bench" / f"tenant-cost-{stamp}"
    w = Workload.model_validate(
        {
            "name": "tenant-cost",
            "overrides": {"tenants.free.weight": 1.0, "tenants.limited.max_queued": 10 * n},
            "sources": {},
            "phases": [],
            "status": "placeholder",
            "skip_reason": "not a workload: its overrides only",
        }
    )
    report: dict[str, Any] = {"requests_per_kind": n}
    with bench_environment(w, run_dir) as settings:
        stack = Stack(settings)
        stack.prepare()
        try:
            stack.start_redis()
            stack.start_worker("text", "batch")
            client = FleetClient(load_settings())
            admin = redis_client(settings)
            for i in range(20):
                client.submit("text", {"text": f"warm up {i}"}).get(timeout_s=120)
            lines = (REPO / "data/text/botchan_sentences.txt").read_text().splitlines()
            texts = [t for t in lines if t.strip()]
            for kind, tenant in KINDS.items():
                reqs = [
                    SubmitRequest("text", {"text": texts[i % len(texts)]}, "bulk", tenant=tenant)
                    for i in range(n)
                ]
                time.sleep(1.0)  # the worker idle: its background commands are few
                c0 = calls(admin)
                handles = client.submit_many(reqs)
                c1 = calls(admin)
                outs = client.wait_all(handles, timeout_s=600, interval_s=0.5)
                time.sleep(1.0)  # the last acks
                c2 = calls(admin)
                assert all(o is not None and "result" in o for o in outs)
                report[kind] = {"submit": delta(c0, c1, n), "submit_and_run": delta(c0, c2, n)}
            report["open_left"] = int(admin.scard("fleet:tenant:limited:open"))
            client.close()
        finally:
            stack.down()
            shutil.rmtree(run_dir / "redis", ignore_errors=True)
    return report


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3000), indent=1))
