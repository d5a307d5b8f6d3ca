"""The gateway's create path is crash-safe: a real gateway process SIGKILLed at each point
of it (``producer.gateway.crashpoints``: it waits there), then the same request sent again
with the same id to another gateway, as the README advises, ends with one final result from
one run. Before the record and the message became one step, a kill between them stranded
the job: the retry answered 202 and the job stayed PENDING for a day."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from producer.stack.local import Stack, free_port
from shared import schema
from shared.procs import running
from shared.redis_client import redis_client
from tests.conftest import own_text_stack

pytestmark = pytest.mark.integration
DATA = Path(__file__).resolve().parents[2] / "data"
NASA = DATA / "videos" / "torchcodec_nasa_13013.mp4"  # 657 KB: its input goes through /dev/shm


@dataclass
class Fleet:
    st: Stack
    token: str

    def url(self, port: int | None = None) -> str:
        return f"http://{self.st.s.gateway.host}:{port or self.st.s.gateway.port}"

    def log(self, name: str) -> str:
        path = self.st.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A text and a video worker and a gateway; the gateways killed here run beside it."""
    shm_root = Path(f"/dev/shm/mmfleet-gwcrash-{os.getuid()}-{secrets.token_hex(4)}")
    overrides = {
        "FLEET_TRANSPORT__SHM_ROOT": str(shm_root),
        "FLEET_MODELS__VIDEO-EFFICIENTNET-LITE0__SAMPLE_FPS": "4",  # 16 frames: a short run
        "FLEET_MODELS__VIDEO-EFFICIENTNET-LITE0__MAX_FRAMES": "16",
    }
    try:
        with own_text_stack(tmp_path_factory, "gw-crash", overrides) as st:
            st.start_worker("video")
            st.start_gateway()
            yield Fleet(st, st.s.gateway_token())
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)


def body(modality: str) -> tuple[str, dict[str, Any]]:
    """The model and the OIP body of one request of ``modality``."""
    if modality == "video":
        data = base64.b64encode(NASA.read_bytes()).decode()
        inp = {"name": "video", "datatype": "BYTES", "shape": [1], "data": [data]}
        return "video-efficientnet-lite0", {"inputs": [inp], "parameters": {"priority": "bulk"}}
    inp = {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["Once, after a crash."]}
    return "minilm", {"inputs": [inp]}


def start_paused_gateway(fleet: Fleet, point: str) -> tuple[int, int]:
    """A second gateway on a port of its own that waits at ``point`` (its pid, its port)."""
    port = free_port()
    env = {
        **fleet.st.env(),
        "FLEET_GATEWAY__PORT": str(port),
        "FLEET_DEBUG_PAUSE_AT": point,
        "FLEET_DEBUG_PAUSE_S": "120",
    }

    def ok() -> bool:
        try:
            return httpx.get(f"{fleet.url(port)}/v2/health/live", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    argv = [sys.executable, "-m", "producer.cli", "gateway"]
    proc = fleet.st.start_process("gateway-paused", argv, ok, 60.0, env)
    return proc.pid, port


def wait_for(check: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)


def runs(fleet: Fleet, modality: str, task_id: str) -> list[str]:
    """The states the worker finished ``task_id`` with (one log line per run)."""
    text = fleet.log(f"worker-{modality}")
    return re.findall(rf"request id={re.escape(task_id)} state=(\w+)", text)


@pytest.mark.parametrize(
    ("point", "modality"),
    [
        ("inputs-written", "video"),
        ("before-push", "text"),
        ("before-push", "video"),
        ("after-push", "text"),
    ],
)
def test_a_gateway_killed_at_each_point_leaves_a_job_its_retry_finishes_once(
    fleet: Fleet, point: str, modality: str
) -> None:
    task_id = f"crash-{point}-{modality}-{uuid.uuid4().hex[:8]}"
    model, payload = body(modality)
    headers = {"Authorization": f"Bearer {fleet.token}", "Idempotency-Key": task_id}
    pid, port = start_paused_gateway(fleet, point)
    answered: list[Any] = []

    def first_try() -> None:  # its gateway dies under it
        try:
            answered.append(
                httpx.post(
                    f"{fleet.url(port)}/v2/models/{model}/infer",
                    json=payload,
                    headers={**headers, "Prefer": "respond-async"},
                    timeout=60.0,
                )
            )
        except httpx.HTTPError as exc:
            answered.append(exc)

    sender = threading.Thread(target=first_try, daemon=True)
    sender.start()
    wait_for(
        lambda: f"debug pause at {point} (job {task_id})" in fleet.log("gateway-paused"),
        f"the gateway to pause at {point}",
    )
    os.killpg(pid, signal.SIGKILL)
    wait_for(lambda: not running(pid), "the gateway to die", 10.0)
    sender.join(10)
    assert answered and isinstance(answered[0], httpx.HTTPError), answered  # no answer came

    # The retry, on the other gateway: one final result.
    r = httpx.post(
        f"{fleet.url()}/v2/models/{model}/infer",
        json=payload,
        headers={**headers, "Prefer": "wait=20"},
        timeout=60.0,
    )
    assert r.status_code == 200, (r.status_code, r.text[:300])
    assert r.json()["parameters"]["job_id"] == task_id
    time.sleep(0.5)  # the worker's log line follows its result
    assert runs(fleet, modality, task_id) == ["SUCCESS"]  # sent once, run once
    admin = redis_client(fleet.st.s, role="admin")
    try:  # nothing of it is left in a queue
        queued = [
            m
            for q in (modality, f"{modality}.realtime")
            for p in range(10)
            for m in admin.lrange(schema.priority_list_key(q, p), 0, -1)
        ]
        assert not [m for m in queued if task_id.encode() in m]
    finally:
        admin.close()


# -- behind Sentinel: the transaction and its WAIT on a worker thread ---------------------------
@pytest.fixture(scope="module")
def ha_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A primary, its replica and three sentinels, no worker: a text worker's heartbeat is
    written by hand, so the gateway takes text requests, and they stay queued."""
    from producer.tools.chaos.ha import _ports
    from tests.conftest import own_redis

    port, sentinels = _ports()
    overrides = {
        "FLEET_REDIS__PORT": str(port),
        "FLEET_REDIS__SENTINELS": json.dumps([f"127.0.0.1:{p}" for p in sentinels]),
    }
    with own_redis(tmp_path_factory, "gw-crash-ha", overrides) as st:
        st.start_gateway()
        yield Fleet(st, st.s.gateway_token())


def replica_client(fleet: Fleet) -> Any:
    from producer.stack.sentinel import node_port
    from shared.redis_client import node_client

    s = fleet.st.s
    return node_client(s, s.redis.host, node_port(fleet.st, "redis-replica"), socket_timeout=5)


@pytest.mark.parametrize("point", ["before-push", "after-push"])
def test_behind_sentinel_a_killed_gateways_job_is_queued_once_after_its_retry(
    ha_fleet: Fleet, point: str
) -> None:
    admin = redis_client(ha_fleet.st.s, role="admin")
    replica = replica_client(ha_fleet)
    for key in (schema.live_key("text"), schema.live_key("text", "minilm")):  # as a worker
        admin.zadd(key, {"text@heartbeat-by-hand": time.time() + 3600})
    task_id = f"crash-ha-{point}-{uuid.uuid4().hex[:8]}"
    model, payload = body("text")
    headers = {"Authorization": f"Bearer {ha_fleet.token}", "Idempotency-Key": task_id}
    pid, port = start_paused_gateway(ha_fleet, point)
    url = f"{ha_fleet.url(port)}/v2/models/{model}/infer"
    sender = threading.Thread(target=_post_quietly, args=(url, payload, headers), daemon=True)
    sender.start()
    try:
        wait_for(
            lambda: f"debug pause at {point} (job {task_id})" in ha_fleet.log("gateway-paused"),
            f"the gateway to pause at {point}",
        )
        os.killpg(pid, signal.SIGKILL)
        wait_for(lambda: not running(pid), "the gateway to die", 10.0)
        sender.join(10)
        for _ in range(2):  # the retry, and one more: the job is there once
            r = httpx.post(
                f"{ha_fleet.url()}/v2/models/{model}/infer",
                json=payload,
                headers={**headers, "Prefer": "respond-async"},
                timeout=60.0,
            )
            assert r.status_code == 202, (r.status_code, r.text[:300])
            copies = [
                m
                for node in (admin, replica)
                for p in range(10)
                for m in node.lrange(schema.priority_list_key("text", p), 0, -1)
                if task_id.encode() in m
            ]
            assert len(copies) == 2  # one on the primary, the same one on its replica
            assert replica.get(schema.job_key(task_id)) is not None
    finally:
        admin.close()
        replica.close()


def _post_quietly(url: str, payload: dict[str, Any], headers: dict[str, str]) -> None:
    """A first try whose gateway dies under it (no answer comes)."""
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url, json=payload, headers={**headers, "Prefer": "respond-async"}, timeout=60)
