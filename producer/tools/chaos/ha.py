"""Redis failover drills on a real local Sentinel setup (``make ha-check``, ``reports/ha.json``).

The stack: a primary, a replica and three sentinels (``producer.stack.sentinel``, small
``down-after-milliseconds``), text workers with the real model, on free loopback ports in a
temporary run directory. Each scenario is a fault of the HA drill
(``producer.tools.chaos.faults.FAULTS``) injected once a quarter of its requests are final.
It sends ``requests`` texts: most at once, the rest at a steady rate while the fault
happens, so requests are queued, held in prefetch windows, running and being published when
the primary goes:

- ``sentinel_failover``: ``SENTINEL FAILOVER <master>``;
- ``primary_sigkill``: SIGKILL of the primary's process; the sentinels promote the replica
  after ``down-after-milliseconds``; the killed node is started again (a supervisor's job)
  and returns as a replica, so the next scenario has one again.

Every request's final state is counted as ``fleet chaos`` counts it (``producer.tools.chaos.tally``:
final-state publishes on the result channels, results that changed, the workers' log
lines of finished runs). Row keys beside the chaos ones: ``failover_s`` (fault until the
sentinels name a new primary), ``recover_s`` (fault until requests complete again on the
new primary), ``drain_s`` (fault until every request was final), ``primary_before`` and
``primary_after``, ``submit_retries`` (submits the producer sent again), ``waiters`` and
``waiters_ok`` (clients blocked in ``get()`` across the fault, and those that got their
result).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producer.client import FleetClient, ResultHandle, SubmitRequest
from producer.stack import sentinel
from producer.stack.local import Stack, free_port, isolated_environment, port_in_use
from producer.tools.chaos.faults import FailoverCtx, drill_faults, fault_named
from producer.tools.chaos.load import texts
from producer.tools.chaos.observe import Publishes, Runs, locate, poll_outcomes
from producer.tools.chaos.tally import Seen, row
from shared.redis_client import redis_client

log = logging.getLogger("fleet.chaos")

RECOVER_LIMIT_S = 15.0
WAITERS = 10  # requests a client waits for in get() across the fault
LATE_S = 3.0  # after all are final, watch this long more for late duplicates
SCENARIOS = drill_faults("ha", "sentinel_failover", "primary_sigkill")


@dataclass
class HaOptions:
    requests: int = 2000
    scenarios: tuple[str, ...] = SCENARIOS
    text_workers: int = 2
    trickle_share: float = 0.25  # sent at a steady rate across the fault
    fault_at: float = 0.25  # the fault once this share of the first batch is final
    settle_timeout_s: float = 240.0
    down_after_ms: int = 1000
    out: Path | None = Path("reports/ha.json")
    overrides: dict[str, str] = field(default_factory=dict)
    say: Callable[[str], None] = print


def _ports() -> tuple[int, list[int]]:
    """A primary port whose successor (the replica's) is free too, and 3 sentinel ports."""
    while True:
        port = free_port()
        if port < 65535 and not port_in_use("127.0.0.1", port + 1):
            break
    sentinels: list[int] = []
    while len(sentinels) < 3:
        p = free_port()
        if p not in (port, port + 1, *sentinels):
            sentinels.append(p)
    return port, sentinels


def run(opts: HaOptions) -> dict[str, Any]:
    """Run the scenarios; return the report (also written to ``opts.out`` if set).

    Raises:
        ValueError: a scenario that is not a fault of the HA drill.
        producer.stack.local.StackError: the stack could not be started.
    """
    drill_faults("ha", *opts.scenarios)
    shm_root = Path(f"/dev/shm/mmfleet-{os.getuid()}-ha-{uuid.uuid4().hex[:12]}")
    rows: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="fleet-ha-") as tmp,
        isolated_environment(Path(tmp), _overrides(opts, shm_root)) as settings,
    ):
        st = Stack(settings)
        opts.say(f"ha: starting primary, replica, 3 sentinels and {opts.text_workers} text workers")
        try:
            st.up([], flower=False)
            for i in range(opts.text_workers):
                st.start_worker("text", instance=i)
            _run_scenarios(st, opts, rows)
        finally:
            st.down()
            shutil.rmtree(shm_root, ignore_errors=True)
            _keep_logs_of_misses(st, opts, rows)
    report = {
        "scenarios": rows,
        "recover_limit_s": RECOVER_LIMIT_S,
        "requests_per_scenario": opts.requests,
        "text_workers": opts.text_workers,
        "sentinel_down_after_ms": opts.down_after_ms,
        "wait_replicas": settings.redis.wait_replicas,
        "wait_timeout_ms": settings.redis.wait_timeout_ms,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if opts.out is not None:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps(report, indent=2))
    return report


def _overrides(opts: HaOptions, shm_root: Path) -> dict[str, str]:
    """The drill's settings: free ports, the sentinels, a /dev/shm root of its own."""
    port, sentinels = _ports()
    return {
        "FLEET_TRANSPORT__SHM_ROOT": str(shm_root),
        "FLEET_REDIS__PORT": str(port),
        "FLEET_REDIS__SENTINELS": json.dumps([f"127.0.0.1:{p}" for p in sentinels]),
        "FLEET_REDIS__SENTINEL_DOWN_AFTER_MS": str(opts.down_after_ms),
        "FLEET_REDIS__SENTINEL_FAILOVER_TIMEOUT_MS": "5000",
        "FLEET_METRICS__PORT_BASE": "0",
        **opts.overrides,
    }


def _run_scenarios(st: Stack, opts: HaOptions, rows: list[dict[str, Any]]) -> None:
    """Each scenario in turn on the started stack; a row per scenario into ``rows``."""
    client = FleetClient(st.s)
    pubs = Publishes(redis_client(st.s))
    pubs.start()
    try:
        for i, name in enumerate(opts.scenarios):
            sentinel.wait_settled(st)
            rows.append(_scenario(st, client, pubs, name, opts, seed=i))
            r = rows[-1]
            opts.say(
                f"ha: {name}: sent {r['sent']} completed {r['completed']} lost "
                f"{r['lost']} dup_results {r['duplicated_results']} dup_runs "
                f"{r['duplicated_executions']} failover_s {r['failover_s']} "
                f"recover_s {r['recover_s']} drain_s {r['drain_s']} get() "
                f"{r['waiters_ok']}/{r['waiters']}"
            )
    finally:
        pubs.stop()
        client.close()


def _keep_logs_of_misses(st: Stack, opts: HaOptions, rows: list[dict[str, Any]]) -> None:
    """Copy the run's logs beside the report when a scenario missed the goal."""
    if opts.out is not None and any(misses_of(r) for r in rows):
        kept = opts.out.parent / "ha-logs"
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(st.logs, kept)
        opts.say(f"ha: logs of this run kept in {kept}")


def misses_of(r: dict[str, Any]) -> list[str]:
    """What a row misses of the goal: 0 lost, 0 duplicated results, recovery in time."""
    out = []
    if r["lost"]:
        out.append(f"{r['lost']} lost")
    if r["duplicated_results"]:
        out.append(f"{r['duplicated_results']} duplicated results")
    if r["recover_s"] is None or r["recover_s"] > RECOVER_LIMIT_S:
        out.append(f"recover_s {r['recover_s']} > {RECOVER_LIMIT_S}")
    if r.get("waiters_ok") != r.get("waiters"):
        out.append(f"get() answered {r.get('waiters_ok')} of {r.get('waiters')} waiting clients")
    return out


class _Sender:
    """Sends requests, retrying a failed submit with the same requests (a broker in the
    middle of a failover), and records the ids whose publish returned."""

    def __init__(self, client: FleetClient, seen: Seen) -> None:
        self.client = client
        self.seen = seen
        self.errors = 0
        self.handles: dict[str, ResultHandle] = {}
        self._lock = threading.Lock()

    def send(self, reqs: list[SubmitRequest], deadline_s: float = 120.0) -> None:
        end = time.monotonic() + deadline_s
        while True:
            try:
                handles = self.client.submit_many(reqs)
                break
            except Exception as exc:
                self.errors += 1
                if time.monotonic() > end:
                    raise
                log.debug("submit failed (retrying): %s", exc)
                time.sleep(0.2)
        with self._lock:
            self.seen.sent.extend(h.id for h in handles)
            self.handles.update((h.id, h) for h in handles)


def _requests(n: int, rng_seed: int) -> list[SubmitRequest]:
    pool = texts()
    return [
        SubmitRequest(
            "text",
            {"text": pool[(rng_seed * 7919 + i) % len(pool)]},
            "bulk",  # no deadline: every request must end SUCCESS
            task_id=str(uuid.uuid4()),
        )
        for i in range(n)
    ]


def _scenario(
    st: Stack, client: FleetClient, pubs: Publishes, name: str, opts: HaOptions, seed: int
) -> dict[str, Any]:
    seen = Seen()
    runs = Runs(st.logs)
    runs.mark()
    sender = _Sender(client, seen)
    reqs = _requests(opts.requests, seed)
    n_trickle = int(len(reqs) * opts.trickle_share)
    first, trickle = reqs[: len(reqs) - n_trickle], reqs[len(reqs) - n_trickle :]
    for i in range(0, len(first), 200):
        sender.send(first[i : i + 200])
    poller = _Poller(client, seen)
    end = time.monotonic() + 120
    while len(poller.done_at) < opts.fault_at * len(first) and time.monotonic() < end:
        time.sleep(0.05)
    trickler = _start(_trickle_out, sender, trickle, name="ha-trickle")
    # Clients blocked in get() (Celery's result consumer, subscribed on the primary) across
    # the fault: the last requests of the first batch finish after it.
    waiting = [sender.handles[r.task_id] for r in first[-WAITERS:] if r.task_id]
    waited: list[bool] = []
    waiter_thread = _start(_wait_all, st, waiting, waited, name="ha-get")
    time.sleep(0.5)
    ctx = FailoverCtx(stack=st, seen=seen, before=sentinel.current_primary(st))
    t_fault = time.monotonic()
    fault_named(name, "ha").inject(ctx)  # returns once a new primary is named (or not)
    before, after, t_new = ctx.before, ctx.after, seen.fault_end_s
    trickler.join(180)
    for killed in sorted(ctx.targeted):  # a supervisor brings a killed node back: as a replica
        st.stop(killed, timeout_s=1)
        sentinel.start_node(st, killed)
    ids = list(dict.fromkeys(seen.sent))
    seen.all_final_s = poller.settle(ids, opts.settle_timeout_s)
    waiter_thread.join(120)
    time.sleep(LATE_S)
    seen.last = poll_outcomes(client, ids)
    seen.publishes = pubs.counts.copy()
    seen.executions = runs.counts()
    seen.worker_exited = any(not ok for n, ok in st.status().items() if n.startswith("worker-"))
    out = row(name, seen)
    if out["lost_ids"]:
        r = redis_client(st.s, socket_timeout=5)
        for tid, where in locate(r, out["lost_ids"]).items():
            opts.say(f"ha: {name}: lost {tid}: {where}")
    resumed = [t for t in poller.done_at.values() if t > t_new]
    trickle_ids = {r.task_id for r in trickle}
    out.update(
        recover_s=round(min(resumed) - t_fault, 2) if resumed else None,
        drain_s=round(seen.all_final_s - t_fault, 2) if seen.all_final_s else None,
        failover_s=round(t_new - t_fault, 2) if after else None,
        primary_before=f"{before[0]}:{before[1]}" if before else None,
        primary_after=f"{after[0]}:{after[1]}" if after else None,
        submit_retries=sender.errors,
        lost_sent_at_fault=sum(1 for t in out["lost_ids"] if t in trickle_ids),
        waiters=len(waiting),
        waiters_ok=sum(waited),
    )
    pubs.counts.clear()
    return out


def _start(target: Callable[..., Any], *args: Any, name: str) -> threading.Thread:
    t = threading.Thread(target=target, args=args, name=name, daemon=True)
    t.start()
    return t


def _trickle_out(sender: _Sender, trickle: list[SubmitRequest]) -> None:
    """Send ``trickle`` five at a time at a steady rate (across the fault)."""
    for i in range(0, len(trickle), 5):
        sender.send(trickle[i : i + 5])
        time.sleep(0.05)


class _Poller:
    """Polls the outcomes of everything sent, in a thread, recording when each was first
    seen final (``done_at``: id -> monotonic seconds)."""

    def __init__(self, client: FleetClient, seen: Seen) -> None:
        self.client, self.seen = client, seen
        self.done_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = _start(self._poll, name="ha-poll")

    def _poll(self) -> None:
        while not self._stop.is_set():
            pending = [t for t in list(self.seen.sent) if t not in self.done_at]
            got = poll_outcomes(self.client, pending)
            now = time.monotonic()
            for tid, out in got.items():
                self.done_at.setdefault(tid, now)
                self.seen.first.setdefault(tid, out)
            time.sleep(0.1)

    def settle(self, ids: list[str], timeout_s: float) -> float | None:
        """Wait up to ``timeout_s`` for every id to be final, then stop polling; when the
        last one was first seen final, or ``None`` if some never were."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and any(t not in self.done_at for t in ids):
            time.sleep(0.2)
        self._stop.set()
        self._thread.join(10)
        if all(t in self.done_at for t in ids):
            return max(self.done_at.values())
        return None


def _wait_all(st: Stack, handles: list[ResultHandle], out: list[bool]) -> None:
    """``get()`` each handle with a client of its own (its own result subscription)."""
    client = FleetClient(st.s)
    try:
        for h in handles:
            try:
                mine = ResultHandle(client, h.id, h.envelope)
                out.append("result" in mine.outcome(timeout_s=90.0))
            except Exception as exc:
                log.warning("get() of %s failed: %s", h.id, exc)
                out.append(False)
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m producer.tools.chaos.ha`` (``make ha-check``): run the drills, print each row,
    write the report; exit 1 when a scenario misses the goal."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m producer.tools.chaos.ha", description=__doc__)
    p.add_argument("--requests", type=int, default=2000, help="requests per scenario")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--text-workers", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("reports/ha.json"))
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    opts = HaOptions(
        requests=a.requests,
        scenarios=tuple(s for s in a.scenarios.split(",") if s),
        text_workers=a.text_workers,
        out=a.out,
    )
    report = run(opts)
    missed = {r["name"]: misses_of(r) for r in report["scenarios"] if misses_of(r)}
    for name, m in missed.items():
        print(f"ha: {name} misses the goal: {', '.join(m)}")
    print(f"ha: report written to {a.out}")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
