"""Real text workers whose wall clocks are an hour off (libfaketime on their process only;
the machine's clock and Redis' untouched) beside one whose clock is right.

Before deadlines, leases and heartbeats were on Redis' clock (``shared.clock``), the worker
at +1 h ended every request with a deadline ``DEADLINE_EXCEEDED`` and its restore scan took
every other worker's leases for lapsed (their messages ran again: ``DUPLICATE``); the one
at -1 h looked dead to producers (its heartbeats an hour old) and its own leases looked
lapsed to the others. Here every request succeeds once, producers see all three live, and
each skewed worker warns about its clock and exports the skew.
"""

from __future__ import annotations

import re
import socket
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from producer.client import FleetClient, SubmitRequest
from producer.stack.local import replica_metrics_port
from producer.tools.chaos.faketime import FaketimeUnavailable, skewed_env, sweep
from tests.conftest import REPO, free_port_block, own_text_stack

pytestmark = pytest.mark.integration

HOUR = 3600
SKEWED = {1: +HOUR, 2: -HOUR}  # worker instance -> its clock's offset
LOGS = ("worker-text", "worker-text-1", "worker-text-2")


@pytest.fixture(scope="module")
def skew_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    build = tmp_path_factory.mktemp("faketime-build")
    try:
        envs = {i: skewed_env(off, build) for i, off in SKEWED.items()}
    except FaketimeUnavailable as exc:
        pytest.skip(f"cannot skew a worker's clock: {exc}")
    overrides = {
        "FLEET_CONFIG": str(REPO / "configs" / "fleet.toml"),
        "FLEET_METRICS__PORT_BASE": str(free_port_block(12)),
        # short leases: restore scans every 0.4 s, so a scan on a skewed clock would find
        # other workers' leases "lapsed" many times over while they hold messages
        "FLEET_REDIS__LEASE_S": "4",
        # small windows and batches: the backlog spreads over all three workers
        "FLEET_MODALITIES__TEXT__DEVICE__PREFETCH_MULTIPLIER": "4",
        "FLEET_MODALITIES__TEXT__DEVICE__FETCH_LIMIT": "4",
        "FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE": "4",
        "FLEET_MODALITIES__TEXT__BATCHING__MAX_QUEUE_DELAY_MS": "20",
    }
    with own_text_stack(tmp_path_factory, "clock-skew-run", overrides) as st:
        for instance, env in envs.items():
            st.start_worker("text", instance=instance, extra_env=env)
        yield st
    sweep()  # libfaketime's segments of the skewed workers, now ended


def log_text(st: Any, name: str) -> str:
    return (st.logs / f"{name}.log").read_text(errors="replace")


def final_lines(st: Any) -> dict[str, list[str]]:
    """Every ``request id=... state=...`` line, by worker log."""
    pattern = re.compile(r"request id=(\S+) state=(\w+)")
    return {n: pattern.findall(log_text(st, n)) for n in LOGS}  # type: ignore[misc]


def skew_gauge(st: Any, instance: int) -> float | None:
    port = replica_metrics_port(st.s.metrics.port_base, "text", instance)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(r'^fleet_worker_clock_skew_seconds\{modality="text"\} (\S+)$', body, re.M)
    return float(found.group(1)) if found else None


def test_workers_an_hour_off_fail_hide_and_repeat_nothing(skew_stack: Any) -> None:
    st = skew_stack
    client = FleetClient(st.s)
    try:
        host = socket.gethostname()
        nodes = {f"text@{host}"} | {f"text-{i}@{host}" for i in SKEWED}
        seen = []
        for _ in range(8):  # over two renewal periods: every heartbeat read, none missed
            seen.append(set(client.live_workers("text")))
            time.sleep(0.2)
        assert all(s == nodes for s in seen), f"live workers seen: {seen}"

        handles = []
        for wave in range(8):  # waves: every worker holds messages while others scan
            reqs = [
                SubmitRequest(
                    "text",
                    {"text": f"Wave {wave} sentence {i} about a quiet river at dawn."},
                    priority="normal" if i % 2 else "bulk",  # bulk: no deadline at all
                    timeout_s=60.0 if i % 2 else None,  # a generous deadline
                )
                for i in range(24)
            ]
            handles += client.submit_many(reqs)
            time.sleep(0.3)
        outcomes = client.wait_all(handles, timeout_s=180)
        errors = [o for o in outcomes if o is None or "error" in o]
        assert not errors, f"{len(errors)} of {len(handles)} failed, e.g. {errors[:3]}"

        deadline = time.monotonic() + 20  # the last log lines follow the results
        ids = {h.id for h in handles}
        while time.monotonic() < deadline:
            lines = final_lines(st)
            logged = [i for n in LOGS for i, _s in lines[n] if i in ids]
            if len(set(logged)) == len(ids):
                break
            time.sleep(0.2)
        states = [s for n in LOGS for i, s in lines[n] if i in ids]
        assert "DUPLICATE" not in states, "a message ran on two workers"
        assert len(logged) == len(ids) and states.count("SUCCESS") == len(ids)
        for n in LOGS:  # each worker, skewed or not, ran some of them
            assert any(i in ids for i, _s in lines[n]), f"{n} ran none"

        for instance, off in SKEWED.items():
            text = log_text(st, f"worker-text-{instance}")
            warned = re.findall(r"WARNING.*this host's clock is ([+-][\d.]+) s off Redis'", text)
            assert warned and all(abs(float(w) - off) < 5.0 for w in warned), warned
            skew = skew_gauge(st, instance)
            assert skew is not None and abs(skew - off) < 5.0
        assert abs(skew_gauge(st, 0) or 0.0) < 1.0
        assert "off Redis'" not in log_text(st, "worker-text")
    finally:
        client.close()
