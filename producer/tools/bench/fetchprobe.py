"""A closed-loop text driver for comparing the worker's fetch paths, with per-thread CPU.

``python -m producer.tools.bench.fetchprobe --notify 1 --realtime 1 --seconds 40``

Starts Redis and one text worker in an isolated run directory (``producer.stack.local``), keeps
``--concurrency`` BULK texts in flight for ``--seconds`` (after ``--warmup``), and prints one
JSON line: throughput, the worker's batches (``fleet_stats``), the CPU milliseconds each
worker thread, Redis and this driver used per completed request, and each worker thread's
voluntary/involuntary context switches per request (``/proc/<pid>/task/*/{stat,status}``).
CPU per request survives a busy machine far better than throughput does.
``--pyspy SECONDS`` records a py-spy profile of the worker meanwhile (``--pyspy-out``,
``--pyspy-args "--idle --native"``); ``--strace SECONDS`` an ``strace -c -f``. Stops
everything it started.

Fetch counters and ``--toggle``: with ``fetchprobe-instrumentation.patch`` (beside this file)
applied to ``workers/consumer/channel.py`` (``git apply``; do not commit it), the worker writes its
fetch counters (notification takes and their sizes, pushes parsed, PINGs, refused takes,
BRPOP reads) to a file every second, and ``--toggle N`` switches the running worker between
notification fetch and BRPOP every N seconds (the same process, warm model, same load): an
A/B that interleaves whatever else runs on the machine. Segments are reported as ``SEG``
lines and per-mode medians as ``AGG``. Without the patch the counters stay empty and
``--toggle`` is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        out[f"{tid}:{comm}"] = (int(fields[11]) + int(fields[12])) / TICK
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                st = dict(line.split(":", 1) for line in f if ":" in line)
            out[f"{tid}:{comm}:vcsw"] = int(st["voluntary_ctxt_switches"]) / 1000.0
            out[f"{tid}:{comm}:ivcsw"] = int(st["nonvoluntary_ctxt_switches"]) / 1000.0
        except (OSError, KeyError, ValueError):
            pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--notify", type=int, default=1)
    ap.add_argument("--realtime", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=384)
    ap.add_argument("--pyspy", type=float, default=0.0)
    ap.add_argument("--pyspy-out", default="")
    ap.add_argument("--pyspy-args", default="--idle")
    ap.add_argument("--strace", type=float, default=0.0)
    ap.add_argument("--toggle", type=float, default=0.0, help="switch fetch mode every N s")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the worker")
    a = ap.parse_args()

    from producer.stack.local import Stack, isolated_environment

    extra = {
        "FLEET_REDIS__FETCH_NOTIFY": "true" if a.notify else "false",
        "FLEET_MODALITIES__TEXT__BATCHING__REALTIME_LANE": "true" if a.realtime else "false",
    }
    for kv in a.env:
        k, _, v = kv.partition("=")
        extra[k] = v
    run_dir = Path(tempfile.mkdtemp(prefix="fetchprobe-", dir="/tmp"))
    extra.setdefault("FLEET_DEBUG_FETCH_COUNTERS", str(run_dir / "fetch-counters.json"))
    extra.setdefault("FLEET_DEBUG_FETCH_TOGGLE", str(run_dir / "fetch-toggle"))
    (run_dir / "fetch-toggle").write_text("1" if a.notify else "0")
    TOGGLE[0] = extra["FLEET_DEBUG_FETCH_TOGGLE"]
    with isolated_environment(run_dir, extra) as settings:
        COUNTERS[0] = extra["FLEET_DEBUG_FETCH_COUNTERS"]
        stack = Stack(settings)
        stack.prepare()
        try:
            stack.start_redis()
            t0 = time.monotonic()
            wproc = stack.start_worker("text")
            print(f"worker ready in {time.monotonic() - t0:.0f}s pid={wproc.pid}", flush=True)
            if a.toggle:
                time.sleep(2.5)  # the worker writes its counters every second
                if not Path(COUNTERS[0]).exists():
                    print("--toggle needs fetchprobe-instrumentation.patch applied", flush=True)
                    return 1
            return drive(a, settings, stack, wproc.pid)
        finally:
            stack.down()


def report_segments(rows):
    agg = {0: [], 1: []}
    for mode, (d0, c0, r0, t0, k0), (d1, c1, r1, t1, k1) in rows:
        n = max(d1 - d0, 1)
        cpu = {k: (c1[k] - c0.get(k, 0)) / n * 1000 for k in c1}
        loop = next(v for k, v in cpu.items() if k.endswith(":python") and "csw" not in k)
        inf = max(v for k, v in cpu.items() if "csw" not in k)
        red = sum(r1[k] - r0.get(k, 0) for k in r1 if "csw" not in k) / n * 1000
        row = {
            "mode": mode,
            "rps": n / (t1 - t0),
            "loop_ms": loop,
            "inf_ms": inf,
            "redis_ms": red,
            "takes": (
                k1.get("takes_notify", 0)
                - k0.get("takes_notify", 0)
                + k1.get("brpop_reads", 0)
                - k0.get("brpop_reads", 0)
            )
            / n,
            "notify_takes": k1.get("takes_notify", 0) - k0.get("takes_notify", 0),
            "brpop_reads": k1.get("brpop_reads", 0) - k0.get("brpop_reads", 0),
            "pushes_parsed": (k1.get("replies_read", 0) - k0.get("replies_read", 0)) / n,
            "pings": sum(
                k1.get(x, 0) - k0.get(x, 0)
                for x in ("ping_after_full", "ping_kick", "ping_brpop_start")
            )
            / n,
            "takes_of_1": (
                k1.get("take_n_1", 0)
                - k0.get("take_n_1", 0)
                + k1.get("brpop_n_1", 0)
                - k0.get("brpop_n_1", 0)
            )
            / n,
            "refused": k1.get("take_refused", 0) - k0.get("take_refused", 0),
        }
        agg[mode].append(row)
        print("SEG", json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
    import statistics as st

    for mode, rs in agg.items():
        if rs:
            print(
                "AGG",
                mode,
                len(rs),
                {k: round(st.median(r[k] for r in rs), 3) for k in rs[0]},
                "rps spread",
                [round(r["rps"], 1) for r in rs],
                flush=True,
            )


def stats_now(client):
    try:
        replies = client.app.control.broadcast("fleet_stats", reply=True, timeout=3.0)
        return next((stats for reply in replies or [] for stats in reply.values()), {})
    except Exception as exc:
        return {"error": str(exc)}


COUNTERS = [""]
TOGGLE = [""]


def counters() -> dict:
    try:
        return json.loads(Path(COUNTERS[0]).read_text())
    except Exception:
        return {}


def worker_pid(stack_pid: int) -> int:
    """The celery process (the spawned pid may be a wrapper)."""
    kids = subprocess.run(
        ["pgrep", "-P", str(stack_pid)], capture_output=True, text=True
    ).stdout.split()
    for k in kids:
        with open(f"/proc/{k}/cmdline", "rb") as f:
            if b"celery" in f.read():
                return int(k)
    return stack_pid


def _count_results(settings) -> tuple[list[int], threading.Condition, threading.Event]:
    """Count every result published (``done[0]``) from a pattern subscription on a thread;
    returns ``(done, cond, stop)``: ``cond`` is notified on each result, ``stop`` ends it."""
    import redis

    from shared import schema
    from shared.redis_client import redis_client

    r = redis_client(settings)
    sub = r.pubsub(ignore_subscribe_messages=True)
    sub.psubscribe(f"{schema.RESULT_KEY_PREFIX}*")
    done = [0]
    cond = threading.Condition()
    stop = threading.Event()

    def collect(_client: redis.Redis) -> None:
        # ``_client`` keeps the client alive: collected, it would close the pool's connections
        # (the subscription's included).
        while not stop.is_set():
            try:
                m = sub.get_message(timeout=0.2)
            except Exception:
                return
            if m is not None:
                with cond:
                    done[0] += 1
                    cond.notify()

    threading.Thread(target=collect, args=(r,), daemon=True).start()
    return done, cond, stop


def _start_tracers(a, pid: int) -> tuple[subprocess.Popen | None, subprocess.Popen | None]:
    """py-spy (``--pyspy``) and ``strace -c`` (``--strace``) on the worker, when asked."""
    spy = st = None
    if a.pyspy:
        spy = subprocess.Popen(
            [
                ".venv/bin/py-spy",
                "record",
                "--pid",
                str(pid),
                "--threads",
                *a.pyspy_args.split(),
                "-r",
                "200",
                "-d",
                str(int(a.pyspy)),
                "-f",
                "raw",
                "-o",
                a.pyspy_out or f"/tmp/spy-{a.notify}{a.realtime}.txt",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    if a.strace:
        st = subprocess.Popen(
            [
                "timeout",
                "-s",
                "INT",
                str(a.strace),
                "strace",
                "-c",
                "-f",
                "-p",
                str(pid),
                "-o",
                f"/tmp/strace-{a.notify}{a.realtime}.txt",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    return spy, st


def _toggle(a, segs: dict, now: float, tm0: float, done: list[int], pid: int, rpid: int) -> None:
    """``--toggle``: every ``a.toggle`` s close the running segment and switch fetch mode;
    a segment's start is taken once the switch has settled."""
    seg = int((now - tm0) // a.toggle)
    if seg != segs["cur"]:
        snap = (done[0], thread_cpu(pid), thread_cpu(rpid), now, counters())
        if segs["start"] is not None:
            segs["rows"].append((segs["mode"], segs["start"], snap))
        segs["cur"] = seg
        segs["mode"] = 1 - segs["mode"] if segs["mode"] is not None else a.notify
        Path(TOGGLE[0]).write_text(str(segs["mode"]))
        segs["start"] = None
        segs["settle"] = now + 1.5  # a kick (<= 1 s) switches; let it settle
    if segs["start"] is None and now >= segs["settle"]:
        segs["start"] = (done[0], thread_cpu(pid), thread_cpu(rpid), now, counters())


def _snapshot(done: list[int], pid: int, rpid: int, now: float | None = None) -> dict:
    """Completed requests, the worker's, Redis's and this driver's thread CPU, counters
    (``t``: ``now``, else the clock read after the worker's CPU)."""
    return {
        "done": done[0],
        "cpu": thread_cpu(pid),
        "t": time.monotonic() if now is None else now,
        "redis": thread_cpu(rpid),
        "me": thread_cpu(os.getpid()),
        "counters": counters(),
    }


def _batch_stats(s0: dict, s1: dict) -> dict:
    """The worker's batches between two ``fleet_stats`` replies."""
    sizes0, sizes1 = s0.get("batch_sizes", {}), s1.get("batch_sizes", {})
    sizes = {k: v - sizes0.get(k, 0) for k, v in sizes1.items() if v - sizes0.get(k, 0)}
    nb = sum(sizes.values())
    mean_batch = sum(int(k) * v for k, v in sizes.items()) / max(nb, 1)
    return {
        "batches": nb,
        "mean_batch": round(mean_batch, 2),
        "model_s": round(s1.get("model_s", 0) - s0.get("model_s", 0), 2),
        "triggers": s1.get("triggers"),
    }


def _summary(a, b: dict, e: dict, stats: dict) -> dict:
    """The JSON line: per-request CPU by thread, Redis and driver CPU, counters, between the
    snapshots ``b`` (start of the measured window) and ``e`` (its end)."""
    n = e["done"] - b["done"]
    el = e["t"] - b["t"]
    c0, c1, cpu0, cpu1 = b["counters"], e["counters"], b["cpu"], e["cpu"]
    ct = float(c1.get("t", 0) - c0.get("t", 0)) or 1.0
    cdiff = {k: round((v - c0.get(k, 0)) / max(n, 1), 3) for k, v in c1.items() if k != "t"}
    per = {
        k: round((cpu1.get(k, 0) - cpu0.get(k, 0)) / max(n, 1) * 1000, 3)
        for k in cpu1
        if cpu1.get(k, 0) - cpu0.get(k, 0) > 0.05
    }
    r0, r1, me0, me1 = b["redis"], e["redis"], b["me"], e["me"]
    redis_ms = sum(r1[k] - r0.get(k, 0) for k in r1 if "csw" not in k) / max(n, 1) * 1000
    driver_ms = sum(me1[k] - me0.get(k, 0) for k in me1 if "csw" not in k) / max(n, 1) * 1000
    return {
        "notify": a.notify,
        "realtime": a.realtime,
        "completed": n,
        "seconds": round(el, 1),
        "rps": round(n / el, 1),
        "cpu_ms_per_request_by_thread": per,
        "cpu_ms_per_request_total": round(sum(v for k, v in per.items() if "csw" not in k), 3),
        "redis_cpu_ms_per_request": round(redis_ms, 3),
        "driver_cpu_ms_per_request": round(driver_ms, 3),
        "loadavg": os.getloadavg(),
        "fleet_stats": stats,
        "counters_per_request": cdiff,
        "counter_window_s": round(ct, 1),
    }


def _texts() -> list[str]:
    return [
        line.strip()
        for line in Path("data/text/botchan_sentences.txt").read_text().splitlines()
        if line.strip()
    ]


def drive(a, settings, stack, spawned_pid: int) -> int:
    from producer.client import FleetClient
    from shared import schema
    from shared.schema import Priority

    pid = spawned_pid
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        if b"celery" not in f.read():
            pid = worker_pid(spawned_pid)
    texts = _texts()
    client = FleetClient(settings, role="admin")
    done, cond, stop = _count_results(settings)
    queue = schema.queue_for("text", "bulk")
    prio = Priority.parse("bulk").celery_priority(settings)
    sent = 0
    i = 0
    t_start = time.monotonic()
    t_measure = t_start + a.warmup
    t_end = t_measure + a.seconds
    measured = False
    segs = {"cur": -1, "mode": None, "start": None, "settle": 0.0, "rows": []}
    spy = st = None
    with client.app.producer_or_acquire() as producer:
        while True:
            now = time.monotonic()
            if not measured and now >= t_measure:
                measured = True
                rpid = int((stack.pids / "redis.pid").read_text().split()[0])
                b = _snapshot(done, pid, rpid, now)
                s0 = stats_now(client)
                spy, st = _start_tracers(a, pid)
            if a.toggle and measured:
                _toggle(a, segs, now, b["t"], done, pid, rpid)
            if now >= t_end:
                break
            with cond:
                while sent - done[0] >= a.concurrency:
                    cond.wait(0.1)
            env = client.envelope("text", {"text": texts[i % len(texts)]}, "bulk")
            i += 1
            client.publish(producer, env, str(uuid.uuid4()), queue, prio)
            sent += 1
    e = _snapshot(done, pid, rpid)
    stop.set()
    if spy is not None:
        spy.wait(timeout=60)
    if st is not None:
        st.wait(timeout=60)
    if a.toggle:
        report_segments(segs["rows"])
    stats = _batch_stats(s0, stats_now(client))
    print(json.dumps(_summary(a, b, e, stats), default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
