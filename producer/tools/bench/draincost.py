"""``python -m producer.tools.bench.draincost``: what one worker spends per request draining a
backlog, with nothing else running.

``fleet bench overhead-saturate`` measures the worker while the bench's producer and Redis
share the machine's cores with it; on two cores their contention moves the worker's CPU per
request by 10-20 % from run to run, more than most single changes to the worker's path. This
measures the worker alone: on a stack of its own (the bench's environment, the identity model),
``--requests`` BULK texts are submitted (``FleetClient.submit_many``) *before* the worker starts;
then the worker starts and drains them while the tool only polls. The window runs from the
moment the queue first shrinks (the worker's first take: its start-up and warm-up are outside)
until every result is stored; over it the tool reads the worker's CPU (``/proc`` utime + stime
of its process tree, :mod:`producer.tools.bench.accounting`), Redis's CPU and commands
(``INFO``), and the requests completed in it. ``--rounds`` repeats it with a fresh worker.

``--profile DIR`` records the worker with ``py-spy`` over the window of every round (raw
collapsed stacks, ``DIR/round-<k>.txt``; summed by :func:`summarize` when printed with
``--top``). Prints one JSON object: per round and the medians.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from producer.tools.bench.accounting import CLK_TCK, parse_stat, tree_ticks
from producer.tools.bench.workload import REPO, Workload

TEXT_FILE = REPO / "data/text/botchan_sentences.txt"


def _proc_table() -> dict[int, Any]:
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                out[int(d.name)] = parse_stat((d / "stat").read_text())
            except (OSError, ValueError):
                continue
    return out


def worker_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds of ``pid``'s living process tree (and the children it reaped), and the
    kernel's share of them (``stime``: its system calls, the socket reads and writes)."""
    procs = _proc_table()
    pids = tree_ticks(procs, pid)
    kernel = sum(procs[p].stime + procs[p].cstime for p in pids)
    return sum(pids.values()) / CLK_TCK, kernel / CLK_TCK


def redis_cpu_s(admin: Any) -> float:
    info = admin.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def redis_commands(admin: Any) -> dict[str, tuple[int, int]]:
    """``INFO commandstats``: calls and microseconds by command (the harness's INFO left out)."""
    stats = admin.info("commandstats")
    return {
        k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
        for k, v in stats.items()
        if k != "cmdstat_info"
    }


def command_delta(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], n: int
) -> dict[str, dict[str, float]]:
    """Per request, by command (those that ran), calls and Redis microseconds, most time first."""
    out = {}
    for k, (calls, usec) in after.items():
        c0, u0 = before.get(k, (0, 0))
        if calls != c0:
            out[k] = {"calls": round((calls - c0) / n, 3), "us": round((usec - u0) / n, 2)}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us"]))


def summarize(path: Path, top: int = 25) -> list[tuple[str, float]]:
    """Inclusive share of samples per function (``file:function``) in a py-spy raw file."""
    counts: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        seen = set()
        for frame in stack.split(";"):
            name = frame.split(" (")[0] + " " + frame.split(" (")[-1].split(":")[0]
            if name not in seen:
                seen.add(name)
                counts[name] += int(n)
    return [(k, round(100.0 * v / max(total, 1), 1)) for k, v in counts.most_common(top)]


def one_round(n: int, settings: Any, stack: Any, profile: Path | None, k: int) -> dict[str, Any]:
    from producer.client import FleetClient, SubmitRequest
    from shared.redis_client import redis_client
    from shared.settings import load_settings

    client = FleetClient(load_settings())
    admin = redis_client(settings)
    texts = [t for t in TEXT_FILE.read_text().splitlines() if t.strip()]
    reqs = [SubmitRequest("text", {"text": texts[i % len(texts)]}, "bulk") for i in range(n)]
    handles = client.submit_many(reqs)
    queues = [k for k in admin.keys("text*") if b"@" not in k and b"realtime" not in k]

    def queued() -> int:
        return sum(int(admin.llen(q)) for q in queues)

    backlog = queued()
    # spawned without waiting for its ping: the drain may be over before a ping answers
    proc = stack._spawn(stack.worker_name("text"), stack.worker_argv("text", "batch"))
    while queued() >= backlog:
        time.sleep(0.002)
    w0, r0, c0, t0 = worker_cpu_s(proc.pid), redis_cpu_s(admin), redis_commands(admin), time.time()
    spy = None
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        spy = subprocess.Popen(
            [shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"), "record",
             "--subprocesses", "--gil", "--pid", str(proc.pid), "-r", "200", "-f", "raw",
             "-o", str(profile / f"round-{k}.txt"), "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    done_at_start = n - backlog
    tail, deadline = handles[-64:], time.monotonic() + 300
    while time.monotonic() < deadline:  # a cheap poll: the queue empty, the last ones stored
        if queued() == 0 and all(o is not None for o in client.poll(tail)):
            break
        time.sleep(0.01)
    w1, r1, c1, t1 = worker_cpu_s(proc.pid), redis_cpu_s(admin), redis_commands(admin), time.time()
    final = client.wait_all(handles, timeout_s=120, interval_s=0.05)
    if spy is not None:
        spy.send_signal(2)
        spy.wait(timeout=30)
    ok = sum(1 for o in final if o is not None and "result" in o)
    counted = n - done_at_start
    client.close()
    return {
        "requests": n,
        "in_window": counted,
        "ok": ok,
        "window_s": round(t1 - t0, 3),
        "requests_per_s": round(counted / (t1 - t0), 1),
        "worker_cpu_us_per_request": round(1e6 * (w1[0] - w0[0]) / counted, 1),
        "worker_kernel_us_per_request": round(1e6 * (w1[1] - w0[1]) / counted, 1),
        "redis_cpu_us_per_request": round(1e6 * (r1 - r0) / counted, 1),
        "redis_commands_per_request": round(
            sum(v["calls"] for v in command_delta(c0, c1, counted).values()), 2
        ),
        "redis_commands": command_delta(c0, c1, counted),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--top", type=int, default=0)
    args = ap.parse_args()
    from producer.stack.local import Stack
    from producer.tools.bench.runner import bench_environment

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    rounds = []
    for k in range(args.rounds):
        run_dir = REPO / ".run" / "bench" / f"drain-cost-{stamp}-{k}"
        w = Workload.model_validate(
            {
                "name": "drain-cost",
                "overrides": {"modalities.text.model": "identity"},
                "sources": {},
                "phases": [],
                "status": "placeholder",
                "skip_reason": "not a workload: its overrides only",
            }
        )
        with bench_environment(w, run_dir) as settings:
            stack = Stack(settings)
            stack.prepare()
            try:
                stack.start_redis()
                rounds.append(one_round(args.requests, settings, stack, args.profile, k))
            finally:
                stack.down()
                shutil.rmtree(run_dir / "redis", ignore_errors=True)
        print(json.dumps(rounds[-1]), flush=True)
    keys = [k for k in rounds[0] if k.endswith("per_request") or k == "requests_per_s"]
    report: dict[str, Any] = {
        "rounds": rounds,
        "median": {k: statistics.median(r[k] for r in rounds) for k in keys},
    }
    if args.profile is not None and args.top:
        report["profile"] = {
            f.name: summarize(f, args.top) for f in sorted(args.profile.glob("round-*.txt"))
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
