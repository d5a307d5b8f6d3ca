"""What ``WAIT`` costs the producer: submit throughput with and without it.

``python -m producer.tools.bench.waitcost [--requests 3000] [--rounds 3]`` starts a primary, a
replica and three sentinels (``producer.stack.sentinel``, no workers) on free loopback ports and
submits ``requests`` texts with ``FleetClient.submit_many`` (one publish per request, as the
bench generator sends them) ``rounds`` times each way, alternating: ``wait_replicas = 1``
(each publish is ``LPUSH`` + ``WAIT`` on one connection) and ``wait_replicas = 0`` (the
same Sentinel setup, no ``WAIT``); and 5,000 bare ``LPUSH`` pipelines of 1 KiB on one
connection, with and without ``WAIT 1 250`` (microseconds each). Prints one JSON line per
round and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from producer.client import FleetClient, SubmitRequest
from producer.stack.local import Stack, free_port, isolated_environment
from producer.tools.chaos.load import texts
from shared.redis_client import redis_client
from shared.settings import load_settings


def _round(settings: Any, n: int) -> float:
    client = FleetClient(settings)
    pool = texts()
    reqs = [SubmitRequest("text", {"text": pool[i % len(pool)]}, "bulk") for i in range(n)]
    try:
        client.submit_many(reqs[:50])  # connections and bindings warm
        t0 = time.perf_counter()
        for i in range(0, n, 100):
            client.submit_many(reqs[i : i + 100])
        return n / (time.perf_counter() - t0)
    finally:
        client.close()


def _raw(settings: Any, n: int, wait: bool) -> float:
    """Microseconds per ``LPUSH`` (one pipeline each, ``+ WAIT 1 250`` when ``wait``) of a
    1 KiB value on one connection of the primary (through the sentinels)."""
    r = redis_client(settings, "producer")
    payload = b"x" * 1024
    t0 = time.perf_counter()
    for _ in range(n):
        pipe = r.pipeline(transaction=False)
        pipe.lpush("text-waitcost", payload)
        if wait:
            pipe.execute_command("WAIT", 1, 250)
        pipe.execute()
    us = (time.perf_counter() - t0) / n * 1e6
    redis_client(settings).delete("text-waitcost")
    return us


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m producer.tools.bench.waitcost", description=__doc__)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    port = free_port()
    while free_port() == port + 1:
        port = free_port()
    sentinels = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    overrides = {
        "FLEET_REDIS__PORT": str(port),
        "FLEET_REDIS__SENTINELS": json.dumps(sentinels),
        "FLEET_TRANSPORT__SHM_ROOT": f"/dev/shm/mmfleet-waitcost-{os.getpid()}",
    }
    rates: dict[str, list[float]] = {"wait": [], "no_wait": []}
    raw: dict[str, list[float]] = {"wait": [], "no_wait": []}
    with (
        tempfile.TemporaryDirectory(prefix="fleet-waitcost-") as tmp,
        isolated_environment(Path(tmp), overrides) as settings,
    ):
        st = Stack(settings)
        st.up([], flower=False)
        try:
            no_wait = load_settings(redis={"wait_replicas": 0})
            admin = redis_client(settings)
            for r in range(a.rounds):
                for name, s in (("wait", settings), ("no_wait", no_wait)):
                    rate = _round(s, a.requests)
                    rates[name].append(rate)
                    admin.delete(*[k for k in admin.scan_iter("text*")] or ["-"])
                    us = _raw(settings, 5000, name == "wait")
                    raw[name].append(us)
                    print(
                        json.dumps(
                            {
                                "round": r,
                                "mode": name,
                                "submits_per_s": round(rate, 1),
                                "lpush_us": round(us, 1),
                            }
                        )
                    )
        finally:
            st.down()
    med = {k: round(statistics.median(v), 1) for k, v in rates.items()}
    cost = 1 - med["wait"] / med["no_wait"]
    med_us = {k: round(statistics.median(v), 1) for k, v in raw.items()}
    print(
        json.dumps(
            {
                "median_submits_per_s": med,
                "wait_cost_share": round(cost, 3),
                "median_lpush_us": med_us,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
