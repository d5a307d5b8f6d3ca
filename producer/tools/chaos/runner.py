"""Run chaos scenarios on a stack of their own and write ``reports/chaos.json``.

The stack: Redis (AOF), two text workers (``worker-text``, ``worker-text-1``), an image
worker and, unless ``with_video`` is false, a video worker, on free loopback ports in a
temporary run directory. Scenarios run one after the other on it; between them every
worker is brought back (a supervisor's job) and the queues drain.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producer.client import FleetClient
from producer.stack.local import Stack, free_port, isolated_environment
from producer.tools.chaos import faketime
from producer.tools.chaos.faults import FAULTS, ChaosCtx, parse_target, pid_of
from producer.tools.chaos.load import Load, LoadSpec
from producer.tools.chaos.observe import Publishes, Runs, locate, poll_outcomes
from producer.tools.chaos.scenarios import Scenario
from producer.tools.chaos.tally import Seen, row, verdict
from shared.redis_client import redis_client

log = logging.getLogger("fleet.chaos")

RECOVER_LIMIT_S = 15.0  # the goal: every request final within this of the fault's end
LATE_S = 3.0  # after all are final, watch this long more for late duplicates


@dataclass
class Options:
    scenarios: list[Scenario]
    load: LoadSpec
    with_video: bool = True
    text_workers: int = 2
    out: Path = Path("reports/chaos.json")
    overrides: dict[str, str] = field(default_factory=dict)
    say: Callable[[str], None] = print


def workers_of(opts: Options) -> list[str]:
    names = [Stack.worker_name("text", i) for i in range(opts.text_workers)]
    names.append(Stack.worker_name("image"))
    if opts.with_video:
        names.append(Stack.worker_name("video"))
    return names


def run(opts: Options) -> dict[str, Any]:
    """Run every scenario; return the report (also written to ``opts.out``).

    Raises:
        producer.stack.local.StackError: the stack could not be started.
    """
    # A /dev/shm root of its own, removed at the end: the video worker's outputs are
    # detached segments the runner never reads (they would live out their TTL otherwise).
    shm_root = Path(f"/dev/shm/mmfleet-{os.getuid()}-chaos-{uuid.uuid4().hex[:12]}")
    overrides = {
        "FLEET_TRANSPORT__SHM_ROOT": str(shm_root),
        "FLEET_REDIS__PORT": str(free_port()),
        "FLEET_METRICS__PORT_BASE": "0",
        **opts.overrides,
    }
    rows: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="fleet-chaos-") as tmp,
        isolated_environment(Path(tmp), overrides) as settings,
    ):
        st = Stack(settings)
        names = workers_of(opts)
        opts.say(f"chaos: starting redis and {', '.join(names)}")
        st.up([], flower=False)
        try:
            for name in names:
                modality, instance = parse_target(name)
                st.start_worker(modality, instance=instance)
            _run_scenarios(st, opts, names, rows)
        finally:
            st.down()
            shutil.rmtree(shm_root, ignore_errors=True)
            faketime.sweep()  # what libfaketime left of the clock_skew scenario's workers
            _keep_logs_if_failed(st, opts, rows)
    return _write_report(opts, rows, settings.redis.lease_s)


def _run_scenarios(st: Stack, opts: Options, names: list[str], rows: list[dict[str, Any]]) -> None:
    """Run ``opts.scenarios`` one after the other on the started stack, appending each one's
    row to ``rows`` as it ends (a failing scenario leaves the rows before it)."""
    client = FleetClient(st.s)
    pubs = Publishes(redis_client(st.s))
    pubs.start()
    try:
        for i, sc in enumerate(opts.scenarios):
            rows.append(_scenario(st, client, pubs, sc, opts, names, seed=i))
            r = rows[-1]
            opts.say(
                f"chaos: {sc.name}: sent {r['sent']} completed {r['completed']} "
                f"lost {r['lost']} dup_results {r['duplicated_results']} "
                f"dup_runs {r['duplicated_executions']} recover_s {r['recover_s']} "
                f"exited {r['worker_exited']} restarts {r['worker_restart_s']}"
            )
    finally:
        pubs.stop()
        client.close()


def _keep_logs_if_failed(st: Stack, opts: Options, rows: list[dict[str, Any]]) -> None:
    """Copy the stack's logs next to the report when a scenario lost, duplicated or saw a
    worker exit (the run directory is removed afterwards)."""
    if any(r["lost"] or r["duplicated_results"] or r["worker_exited"] for r in rows):
        kept = opts.out.parent / "chaos-logs"
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(st.logs, kept)
        opts.say(f"chaos: logs of this run kept in {kept}")


def _write_report(opts: Options, rows: list[dict[str, Any]], lease_s: float) -> dict[str, Any]:
    """The report of ``rows``, written to ``opts.out`` (JSON) and returned."""
    report = {
        "scenarios": rows,
        "recover_limit_s": RECOVER_LIMIT_S,
        "lease_s": lease_s,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(report, indent=2))
    return report


def _scenario(
    st: Stack, client: FleetClient, pubs: Publishes, sc: Scenario, opts: Options,
    names: list[str], seed: int,
) -> dict[str, Any]:  # fmt: skip
    seen = Seen()
    runs = Runs(st.logs)
    runs.mark()
    pids = {n: pid_of(st, n) for n in names}
    load = Load(client, opts.load, opts.with_video and sc.modality == "video", seed).start()
    r = redis_client(st.s, socket_timeout=5)
    ctx = ChaosCtx(stack=st, client=client, r=r, load=load, sc=sc, seen=seen)
    try:
        time.sleep(opts.load.warmup_s)
        FAULTS[sc.fault].inject(ctx)
    finally:
        load.stop()
    seen.sent = [*load.order, *seen.sent]
    _settle(client, seen, opts.load.settle_timeout_s)
    for t in ctx.restarts:
        t.join(180)
    lost = [t for t in dict.fromkeys(seen.sent) if t not in seen.last]
    if lost:
        for tid, where in locate(r, lost[:20]).items():
            opts.say(f"chaos: {sc.name}: lost {tid}: {where}")
    seen.publishes = pubs.counts
    seen.executions = runs.counts()
    seen.worker_exited = any(
        n not in ctx.targeted and (not st.alive(n) or pid_of(st, n) != pids[n]) for n in names
    )
    _release_videos(client, load)
    for n in names:  # a supervisor's job: bring back whatever is down
        if not st.alive(n):
            st.stop(n, timeout_s=1)
            modality, instance = parse_target(n)
            st.start_worker(modality, instance=instance)
    return row(sc.name, seen, sc.fail_states)


def _settle(client: FleetClient, seen: Seen, timeout_s: float) -> None:
    """Poll until every sent request is final (recording first outcomes), then re-read all
    after ``LATE_S`` for results that changed."""
    end = time.monotonic() + timeout_s
    pending = list(dict.fromkeys(seen.sent))
    while pending and time.monotonic() < end:
        got = poll_outcomes(client, pending)
        for tid, out in got.items():
            seen.first.setdefault(tid, out)
        pending = [t for t in pending if t not in got]
        if pending:
            time.sleep(0.1)
    if not pending:
        seen.all_final_s = time.monotonic()
    time.sleep(LATE_S)
    seen.last = poll_outcomes(client, dict.fromkeys(seen.sent))


def _release_videos(client: FleetClient, load: Load) -> None:
    for h in load.handles.values():
        if h.envelope.modality == "video":
            client.release_inputs(h.envelope.inputs)


def misses(report: dict[str, Any]) -> dict[str, list[str]]:
    """Each scenario that misses the goal, with what it misses."""
    out = {}
    for r in report["scenarios"]:
        m = verdict(r, report["recover_limit_s"])
        if m:
            out[r["name"]] = m
    return out
