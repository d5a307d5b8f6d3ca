"""What the Kubernetes manifests (deploy/k8s) rely on, on a real stack of its own: a Redis
and one text worker with a small prefetch window (16), a short drain (soft_shutdown_timeout_s
2 s) and its metrics port on.

- Readiness: the port the startup and readiness probes GET opens only once the worker
  consumes (model loaded and warmed in worker_init, before the consumer starts).
- Scale-in: SIGTERM to the worker's PID 1 process only, as the kubelet sends it, while it
  holds a full window, runs a batch longer than its drain and has a backlog in Redis: every
  request ends with exactly one final result, none is lost, and the worker hands the running
  batch back (it exits within the drain, well inside the manifests' grace period).

tests/integration/test_reliability.py::test_sigterm_finishes_what_the_window_holds covers
the other branch: a drain long enough to finish what the window holds.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from producer.client import FleetClient, SubmitRequest
from shared import schema
from shared.metrics import metrics_port
from tests.conftest import REPO, free_port_block, own_text_stack

pytestmark = pytest.mark.integration

WINDOW = 16
DRAIN_S = 2.0
BACKLOG = 120


@pytest.fixture(scope="module")
def kstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    overrides = {
        "FLEET_CONFIG": str(REPO / "configs" / "fleet.toml"),
        "FLEET_REDIS__LEASE_S": "3",
        "FLEET_DEBUG__FAULT_INJECTION": "true",
        "FLEET_METRICS__PORT_BASE": str(free_port_block(4)),
        "FLEET_MODALITIES__TEXT__DEVICE__PREFETCH_MULTIPLIER": str(WINDOW),
        "FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE": "8",
        "FLEET_MODALITIES__TEXT__BATCHING__LENGTH_BUCKETS": "[16]",
        "FLEET_MODALITIES__TEXT__BATCHING__REALTIME_LANE": "false",
        "FLEET_MODALITIES__TEXT__SOFT_SHUTDOWN_TIMEOUT_S": str(DRAIN_S),
    }
    with own_text_stack(tmp_path_factory, "scale-in-run", overrides) as st:
        yield st


@pytest.fixture(scope="module")
def kclient(kstack: Any) -> Iterator[FleetClient]:
    c = FleetClient(kstack.s)
    yield c
    c.close()


def metrics_up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def worker_pid(st: Any) -> int:
    pid = st._read_pid(st.pids / "worker-text.pid")
    assert pid is not None
    return pid


def finished(st: Any, task_id: str) -> int:
    """How many times a worker finished ``task_id`` successfully (its log lines)."""
    text = (st.logs / "worker-text.log").read_text(errors="replace")
    return len(re.findall(rf"request id={re.escape(task_id)} state=SUCCESS\b", text))


def test_the_probed_port_opens_only_once_the_worker_consumes(kstack: Any) -> None:
    port = metrics_port(kstack.s, "text")
    assert port is not None
    kstack.stop("worker-text")
    assert not metrics_up(port)
    starter = threading.Thread(target=kstack.start_worker, args=("text",))
    starter.start()
    try:
        deadline = time.monotonic() + kstack.s.stack.ready_timeout_s
        while not metrics_up(port):
            assert time.monotonic() < deadline, "the metrics port never opened"
            time.sleep(0.02)
        # The moment the probe would pass, the consumer already answers (it starts after
        # worker_init loaded and warmed the model): a ping gets a reply at once.
        node = f"text@{socket.gethostname()}"
        assert kstack.worker_ping(node), "the port opened before the worker consumed"
    finally:
        starter.join()


def test_sigterm_with_a_full_window_a_running_batch_and_a_backlog_loses_nothing(
    kstack: Any, kclient: FleetClient
) -> None:
    if not kstack.alive("worker-text"):
        kstack.start_worker("text")
    r = redis.Redis.from_url(kstack.s.redis_url())
    log = kstack.logs / "worker-text.log"
    log_from = log.stat().st_size
    # A batch that runs past the drain, then a backlog far larger than the window.
    blocker = kclient.submit("text", {"text": "The long one.", "_inject": "slow:6"}, "bulk")
    rest = kclient.submit_many(
        [
            SubmitRequest("text", {"text": f"Sentence {i} of the backlog."}, "bulk")
            for i in range(BACKLOG)
        ]
    )
    handles = [blocker, *rest]
    deadline = time.monotonic() + 30
    while r.hlen(schema.UNACKED_KEY) < WINDOW:  # kombu's record of what the window holds
        assert time.monotonic() < deadline, "the window never filled"
        time.sleep(0.02)
    time.sleep(0.5)  # the blocker's batch is running (it sleeps 6 s inside)
    queued = sum(r.llen(schema.priority_list_key("text", p)) for p in schema.PRIORITY_STEPS)
    assert queued >= BACKLOG + 1 - WINDOW - 8, "no backlog left in Redis"
    pid = worker_pid(kstack)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGTERM)  # PID 1 only, as the kubelet does; no process group
    while kstack.alive("worker-text"):
        assert time.monotonic() - t0 < 60, "the worker outlived the manifests' grace period"
        time.sleep(0.05)
    exit_s = time.monotonic() - t0
    print(f"worker exited {exit_s:.1f} s after SIGTERM")
    assert exit_s < DRAIN_S + 10
    shutdown = log.read_text(errors="replace")[log_from:]
    gave = re.search(r"shutdown: gave back (\d+) requests \((\d+) were running\)", shutdown)
    assert gave, "the worker exited without giving back what it held"
    assert int(gave.group(2)) >= 1, "the running batch was neither finished nor handed back"
    # Nothing finished by the old worker after this point: what it held is back in Redis.
    kstack.stop("worker-text", timeout_s=1)
    kstack.start_worker("text")  # the replica that takes over
    outs = kclient.wait_all(handles, timeout_s=120)
    lost = [h.id for h, o in zip(handles, outs, strict=True) if o is None]
    assert not lost, f"{len(lost)} requests never got a final result"
    failed = [o for o in outs if o is not None and "result" not in o]
    assert not failed, failed[:3]
    runs = {h.id: finished(kstack, h.id) for h in handles}
    assert all(n == 1 for n in runs.values()), {k: v for k, v in runs.items() if v != 1}
    deadline = time.monotonic() + 30
    while r.hlen(schema.UNACKED_KEY) or r.llen(schema.priority_list_key("text", 9)):
        assert time.monotonic() < deadline, "messages left unacked or queued"
        time.sleep(0.05)
