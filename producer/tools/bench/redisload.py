"""``python -m producer.tools.bench.redisload``: what one request costs Redis, measured on a stack
of its own (fresh Redis, text workers, free ports).

``--model minilm`` (the default) serves text with the configured MiniLM model;
``--model identity`` serves it with the ``identity`` model (no weights, no compute: its result
is the input's size and CRC-32, ``workers/models/identity.py``), so the figures are the
fleet's own path with a result of a few bytes, what a GPU that computes in no time leaves.
``--workers N`` starts N text workers (default 1): the idle figures are then N workers'
background, and ``idle.per_worker`` divides it by N.

Redis runs commands on one thread, so its ceiling is one core: a fleet saturates Redis when
(requests/s x Redis CPU seconds per request) + (workers x idle CPU seconds per second of one
worker) reaches 1. Both terms are measured here, from the server's own counters:

1. **idle**: the worker idle for ``idle_s``; ``INFO commandstats`` and ``INFO cpu``
   (``used_cpu_sys`` + ``used_cpu_user``) before and after give one worker's background
   commands/s and CPU/s (lease renewals, heartbeats, fetch polls, event flushes, restore
   scans).
2. **load**: ``requests`` text requests enqueued at once (BULK); this waits until the
   queue and kombu's unacked hash are empty (its own ``LLEN``/``HLEN`` polls are subtracted),
   then reads every result once (one ``MGET``); the same deltas, minus the idle background
   over the run's duration, divided by the requests: commands per request (and by command) and
   Redis CPU microseconds per request. ``redis_max_rps`` = 1 s / that CPU time: the request
   rate at which Redis would be busy all the time, with no worker's background.
3. **raw**: pipelined SETs (:func:`raw_ops`): the server's ops/s for a trivial command on
   this machine, to set the fleet's per-request cost against.

Writes one JSON object (``--out``, and stdout)::

    {"started_utc", "machine", "model", "workers", "redis_version",
     "idle": {"s", "commands_per_s", "cpu_us_per_s",
              "per_worker": {"commands_per_s", "cpu_us_per_s"}},
     "load": {"requests", "s", "rps", "commands_per_request", "cpu_us_per_request",
              "usec_in_commands_per_request", "by_command": {cmd: calls per request},
              "usec_per_request_by_command": {cmd: usec per request}},
     "redis_max_rps", "raw_set": {"ops", "pipeline_depth", "ops_per_s", "cpu_us_per_op",
     "server_max_ops_per_s"}}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

from producer.client import FleetClient, SubmitRequest
from producer.stack.local import Stack, isolated_environment
from producer.tools.bench.accounting import counter_delta as _delta
from producer.tools.bench.accounting import redis_counters as _counters
from shared import schema
from shared.redis_client import redis_client

REPO = Path(__file__).resolve().parents[3]
SHM_ROOT = Path("/dev/shm") / f"mmfleet-bench-{os.getpid()}"
# --model: the text model served, and the settings overrides (environment) that select it
MODELS: dict[str, dict[str, str]] = {
    "minilm": {},
    "identity": {"FLEET_MODALITIES__TEXT__MODEL": "identity"},
}


def raw_ops(r: redis.Redis, ops: int = 200_000, depth: int = 1000) -> dict[str, float]:
    """Redis's own rate for a trivial command: ``ops`` SETs of 16-byte values, pipelined
    ``depth`` at a time from one client. ``ops_per_s`` is the wall rate (the Python client
    is part of it); ``cpu_us_per_op`` is the server's CPU per SET, whose inverse
    (``server_max_ops_per_s``) is what one Redis core could serve with clients to spare."""
    value = b"x" * 16
    _, _, cpu0 = _counters(r)
    t0 = time.monotonic()
    for start in range(0, ops, depth):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(start + depth, ops)):
            pipe.set(f"bench:raw:{i % 1000}", value)
        pipe.execute()
    dt = time.monotonic() - t0
    _, _, cpu1 = _counters(r)
    r.delete(*[f"bench:raw:{i}" for i in range(1000)])
    cpu_us = (cpu1 - cpu0) / ops * 1e6
    return {
        "ops": ops,
        "pipeline_depth": depth,
        "ops_per_s": round(ops / dt),
        "cpu_us_per_op": round(cpu_us, 2),
        "server_max_ops_per_s": round(1e6 / cpu_us),
    }


def _wait_drained(r: redis.Redis, timeout_s: float, interval_s: float = 0.5) -> dict[str, int]:
    """Wait until the text queue's lists and kombu's unacked hash are empty (every request
    taken and acked, so its result is stored). Returns the commands this sent, by name.

    Raises:
        TimeoutError: not drained within ``timeout_s``.
    """
    lists = [
        schema.priority_list_key(q, p)
        for q in ("text", "text.realtime")
        for p in schema.PRIORITY_STEPS
    ]
    sent = {"llen": 0, "hlen": 0}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pipe = r.pipeline(transaction=False)
        for key in lists:
            pipe.llen(key)
        pipe.hlen(schema.UNACKED_KEY)
        counts = pipe.execute()
        sent["llen"] += len(lists)
        sent["hlen"] += 1
        if not any(counts):
            return sent
        time.sleep(interval_s)
    raise TimeoutError(f"the text queue did not drain within {timeout_s} s")


def _idle_phase(admin: redis.Redis, idle_s: float) -> dict[str, float]:
    """Commands and Redis CPU seconds per second while nothing is sent (``s``: its length)."""
    c0, _, cpu0 = _counters(admin)
    t0 = time.monotonic()
    time.sleep(idle_s)
    c1, _, cpu1 = _counters(admin)
    idle_dt = time.monotonic() - t0
    return {
        "s": idle_dt,
        "calls": sum(_delta(c0, c1).values()) / idle_dt,
        "cpu": (cpu1 - cpu0) / idle_dt,
    }


def _load_phase(
    client: FleetClient, admin: redis.Redis, texts: list[str], requests: int, idle: dict
) -> dict[str, Any]:
    """Send ``requests`` BULK texts at once and wait for them: commands (less this harness's
    polls), their usec and Redis CPU seconds, each less the ``idle`` rate over the phase.

    Raises:
        RuntimeError: a request did not succeed.
    """
    reqs = [SubmitRequest("text", {"text": texts[i % len(texts)]}, "bulk") for i in range(requests)]
    c2, u2, cpu2 = _counters(admin)
    t2 = time.monotonic()
    handles = client.submit_many(reqs)
    polls = _wait_drained(admin, 600.0)
    dt = time.monotonic() - t2
    outs = client.wait_all(handles, timeout_s=60)  # one MGET: each result read once
    c3, u3, cpu3 = _counters(admin)
    ok = sum(1 for o in outs if o is not None and "result" in o)
    if ok != requests:
        raise RuntimeError(f"only {ok} of {requests} requests succeeded")
    by_cmd = _delta(c2, c3)
    for cmd, n in polls.items():  # this harness's own polling is no request's cost
        by_cmd[cmd] -= n
    return {
        "s": dt,
        "by_cmd": by_cmd,
        "usec": _delta(u2, u3),
        "total": sum(by_cmd.values()) - idle["calls"] * dt,
        "cpu": (cpu3 - cpu2) - idle["cpu"] * dt,
    }


def measure(
    requests: int, idle_s: float, workdir: Path, model: str = "minilm", workers: int = 1
) -> dict[str, Any]:
    """Run the idle and load phases (module doc) with ``workers`` text workers serving
    ``model`` (a key of :data:`MODELS`) and return their figures."""
    # a /dev/shm root of its own, removed afterwards: another stack's is never touched
    overrides = {
        "FLEET_METRICS__PORT_BASE": "0",
        "FLEET_TRANSPORT__SHM_ROOT": str(SHM_ROOT),
        **MODELS[model],
    }
    with isolated_environment(workdir, overrides) as settings:
        stack = Stack(settings)
        stack.up(["text"], flower=False, replicas={"text": workers})
        client = FleetClient(settings)
        admin = redis_client(settings)
        try:
            texts = [
                t
                for t in (REPO / "data/text/botchan_sentences.txt").read_text().splitlines()
                if t.strip()
            ]
            # warm the worker's connections and the producer's pools
            client.wait_all(
                client.submit_many([SubmitRequest("text", {"text": t}) for t in texts[:50]]),
                timeout_s=120,
            )
            time.sleep(2.0)
            idle = _idle_phase(admin, idle_s)
            load = _load_phase(client, admin, texts, requests, idle)
            version = admin.info("server")["redis_version"]
            raw = raw_ops(admin)
        finally:
            client.close()
            stack.down()
    return _figures(requests, idle, load, version, raw, model=model, workers=workers)


def _figures(
    requests: int,
    idle: dict,
    load: dict,
    version: str,
    raw: dict[str, float],
    model: str = "minilm",
    workers: int = 1,
) -> dict[str, Any]:
    """The report: idle rates (all workers', and per worker), per-request commands, usec and
    CPU, the implied Redis limit."""
    dt, by_cmd, usec = load["s"], load["by_cmd"], load["usec"]
    per_req_cpu_us = load["cpu"] / requests * 1e6
    return {
        "model": model,
        "workers": workers,
        "redis_version": version,
        "idle": {
            "s": round(idle["s"], 1),
            "commands_per_s": round(idle["calls"], 1),
            "cpu_us_per_s": round(idle["cpu"] * 1e6),
            "per_worker": {
                "commands_per_s": round(idle["calls"] / workers, 1),
                "cpu_us_per_s": round(idle["cpu"] * 1e6 / workers),
            },
        },
        "load": {
            "requests": requests,
            "s": round(dt, 2),
            "rps": round(requests / dt, 1),
            "commands_per_request": round(load["total"] / requests, 2),
            "cpu_us_per_request": round(per_req_cpu_us, 1),
            "usec_in_commands_per_request": round(sum(usec.values()) / requests, 1),
            "by_command": {
                k: round(v / requests, 3) for k, v in sorted(by_cmd.items(), key=lambda x: -x[1])
            },
            "usec_per_request_by_command": {
                k: round(v / requests, 1) for k, v in sorted(usec.items(), key=lambda x: -x[1])
            },
        },
        "redis_max_rps": round(1e6 / per_req_cpu_us),
        "raw_set": raw,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--model", choices=sorted(MODELS), default="minilm", help="the text model")
    p.add_argument("--workers", type=int, default=1, help="text workers (default 1)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    report: dict[str, Any] = {
        "started_utc": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        },
    }
    try:
        with tempfile.TemporaryDirectory(prefix="fleet-redisload-") as tmp:
            report.update(
                measure(args.requests, args.idle_s, Path(tmp), args.model, max(args.workers, 1))
            )
    finally:
        shutil.rmtree(SHM_ROOT, ignore_errors=True)
    report["machine"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
