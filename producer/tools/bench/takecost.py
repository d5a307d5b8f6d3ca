"""What routing by model costs Redis: the measurement behind docs/decisions.md, "Routing by
model". ``python -m producer.tools.bench.takecost`` (starts a ``redis-server`` of its own on a
free port, removes it after; prints a JSON report).

Two layouts were weighed:

- a queue per model: a worker serving ``k`` models takes from ``k`` queues, so the take script
  (``workers/consumer/take_many.lua``) is given ``10 k`` priority lists; a model's demand is
  ``LLEN`` of its own 10 lists;
- one queue per modality, per-model batches in the worker: the take script sees 10 lists
  whatever ``k``, but a model's demand (what KEDA scales one Deployment by) is only known by
  reading every waiting message (``LRANGE`` and a JSON decode each), and a worker cannot take
  one model's requests out of a shared Redis list.

Measured here, on the exact messages ``FleetClient.submit_many`` builds (a short text, BULK):
Redis' own time per take call (``INFO commandstats``, ``EVALSHA`` ``usec_per_call``) with
``k`` = 1, 2, 4, 8 queues, taking 64 at a time, with the backlog in the last queue (every
list before it empty: the most empty pops), spread over all ``k`` queues, and with every
list empty (an idle worker's take); and the cost of one model's demand in each layout for a
10,000-message backlog.
"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import redis

from producer.client import FleetClient, SubmitRequest
from producer.stack.redis_node import redis_server_binary
from shared import schema
from shared.settings import load_settings
from workers.consumer.channel import TAKE_MANY

TAKE = 64  # messages per take (the text worker's fetch_limit)
CALLS = 200  # take calls per case
BACKLOG = 10_000  # messages waiting, for the demand cost


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _messages(n: int, model: str | None, settings: Any) -> list[tuple[str, bytes]]:
    client = FleetClient(settings)
    reqs = [
        SubmitRequest("text", {"text": f"a short text number {i}"}, "bulk", model=model)
        for i in range(n)
    ]
    sub = client._submission(reqs, time.time() * 1000.0, lambda *_: None)
    out = [(m.key, m.payload) for m in sub.messages]
    client.app.close()
    return out


def _evalsha_usec(r: redis.Redis) -> tuple[float, int]:
    stats = r.info("commandstats").get("cmdstat_evalsha", {})
    return float(stats.get("usec", 0)), int(stats.get("calls", 0))


def _take_case(r: redis.Redis, script: Any, keys: list[str], fill: dict[str, list[bytes]]) -> float:
    """Redis microseconds per take call, the lists refilled before each call."""
    spent = 0.0
    for _ in range(CALLS):
        with r.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.delete(key)
            for key, payloads in fill.items():
                pipe.lpush(key, *payloads)
            pipe.execute()
        u0, c0 = _evalsha_usec(r)
        script(keys=[*keys, "unacked", "unacked_index"], args=[TAKE, repr(time.time()), 0])
        u1, c1 = _evalsha_usec(r)
        spent += (u1 - u0) / max(c1 - c0, 1)
        r.delete("unacked", "unacked_index")
    return round(spent / CALLS, 1)


def main() -> dict[str, Any]:
    port = _free_port()
    work = tempfile.mkdtemp(prefix="takecost-")
    server = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", work, "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        r = redis.Redis(port=port)
        for _ in range(50):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        tables = [f"m{i}" for i in range(8)]
        models = {t: {"kind": "identity"} for t in tables}
        settings = load_settings(
            redis={"host": "127.0.0.1", "port": port, "password": "unused"},  # never sent
            models=models,
            modalities={"text": {"model": "m0", "models": tables}},
        )
        bulk = settings.priorities["bulk"].celery_priority
        script = r.register_script(TAKE_MANY)
        payloads = {
            t: [p for _, p in _messages(TAKE, None if t == "m0" else t, settings)] for t in tables
        }
        takes: dict[str, dict[str, float]] = {}
        for k in (1, 2, 4, 8):
            queues = [schema.model_queue_name("text", None if t == "m0" else t) for t in tables[:k]]
            keys = [schema.priority_list_key(q, p) for p in schema.PRIORITY_STEPS for q in queues]
            last = schema.priority_list_key(queues[-1], bulk)
            spread = {
                schema.priority_list_key(q, bulk): payloads[t][: TAKE // k]
                for q, t in zip(queues, tables, strict=False)
            }
            takes[f"{k} models ({len(keys)} lists)"] = {
                "backlog_in_last_queue_us": _take_case(
                    r, script, keys, {last: payloads[tables[k - 1]]}
                ),
                "backlog_spread_us": _take_case(r, script, keys, spread),
                "all_empty_us": _take_case(r, script, keys, {}),
            }
        # one model's demand, a 10,000-message backlog of 8 models in one queue or in 8
        mixed = [p for t in tables for p in payloads[t]]
        one_queue = schema.priority_list_key("text", bulk)
        r.delete(one_queue)
        for i in range(0, BACKLOG, len(mixed)):
            r.lpush(one_queue, *mixed[: min(len(mixed), BACKLOG - i)])
        t0 = time.perf_counter()
        raw = r.lrange(one_queue, 0, -1)
        counts: dict[str, int] = {}
        for item in raw:  # what an exporter would have to do: decode every message's body
            body = json.loads(item)["body"]
            env = json.loads(base64.b64decode(body))[1]["request"]
            counts[env.get("model") or "m0"] = counts.get(env.get("model") or "m0", 0) + 1
        scan_ms = (time.perf_counter() - t0) * 1000.0
        r.config_resetstat()
        with r.pipeline(transaction=False) as pipe:
            for p in schema.PRIORITY_STEPS:
                pipe.llen(schema.priority_list_key("text@m3", p))
            pipe.execute()
        llen = r.info("commandstats").get("cmdstat_llen", {})
        r.config_resetstat()
        r.lrange(one_queue, 0, -1)
        lrange = r.info("commandstats").get("cmdstat_lrange", {})
        return {
            "take_per_call_redis_us": takes,
            "demand_of_one_model": {
                "queue_per_model_llen_10_lists_redis_us": llen.get("usec"),
                "one_queue_lrange_10000_redis_us": lrange.get("usec"),
                "one_queue_lrange_and_decode_10000_client_ms": round(scan_ms, 1),
                "message_bytes": len(mixed[0]),
            },
            "redis": r.info("server")["redis_version"],
        }
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    json.dump(main(), sys.stdout, indent=2)
    print()
