"""A request's /dev/shm input lives as long as the request may run, on a real stack.

A stack of its own (Redis; text and video workers started and stopped by the tests) with a
shared-memory root of its own and short times: inputs live ``TTL_S`` past their last renewal
and janitors run every ``JANITOR_S``; the orphan test's janitor lets nothing bound to a request
outlive ``CAP_S`` (``[transport] max_ref_lifetime_s``; the others' cap is a day). A video whose
request waits in its queue longer than its TTL (no video worker is running) must still
succeed, and go once it is final (renewed no more); an input whose request never runs must go
at the cap; ``fleet shm gc`` and ``fleet down`` remove the inputs of finished requests and
lapsed leases at once. See ``shared.transport.lifetime``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from producer.client import FleetClient
from tests.conftest import REPO

pytestmark = pytest.mark.integration

TTL_S = 4.0  # [transport] default_ttl_s (>= 4 leases of 1 s, >= 3 janitor intervals)
JANITOR_S = 1.0  # [transport] janitor_interval_s
CAP_S = 12.0  # [transport] max_ref_lifetime_s of the orphan test's janitor
NASA = REPO / "data" / "videos" / "torchcodec_nasa_13013.mp4"  # 657 KB: through /dev/shm


@pytest.fixture(scope="module")
def lstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from producer.stack.local import Stack, isolated_environment

    root = Path(f"/dev/shm/mmfleet-{os.getuid()}-lifetime-{uuid.uuid4().hex[:12]}")
    overrides = {
        "FLEET_CONFIG": str(REPO / "configs" / "fleet.toml"),
        "FLEET_TRANSPORT__SHM_ROOT": str(root),
        "FLEET_TRANSPORT__DEFAULT_TTL_S": str(TTL_S),
        "FLEET_TRANSPORT__JANITOR_INTERVAL_S": str(JANITOR_S),
        "FLEET_REDIS__LEASE_S": "1",
        # a short video: the NASA clip's first second, 8 frames
        "FLEET_MODELS__VIDEO-EFFICIENTNET-LITE0__SAMPLE_FPS": "8",
        "FLEET_MODELS__VIDEO-EFFICIENTNET-LITE0__MAX_FRAMES": "8",
        "FLEET_MODALITIES__TEXT__BATCHING__LENGTH_BUCKETS": "[16]",  # a short warmup
    }
    with isolated_environment(tmp_path_factory.mktemp("lifetime-run"), overrides) as settings:
        st = Stack(settings)
        try:
            st.up([], flower=False)  # Redis only: each test starts the workers it needs
            yield st
            admin = redis.Redis.from_url(st.s.redis_url("admin"), socket_timeout=5)
            denied = admin.execute_command("ACL", "LOG", "20")
            assert denied == [], f"Redis refused fleet processes' commands: {denied}"
        finally:
            st.down()
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def lclient(lstack: Any) -> Iterator[FleetClient]:
    client = FleetClient(lstack.s)  # a producer, as its ACL user
    yield client
    client.close()
    for name in ("worker-text", "worker-video"):
        if lstack.alive(name):
            lstack.stop(name)


def start_worker(stack: Any, modality: str, **env: str) -> None:
    """Start a worker with extra ``FLEET_*`` variables in its environment."""
    mp = pytest.MonkeyPatch()
    for k, v in env.items():
        mp.setenv(k, v)
    try:
        stack.start_worker(modality)
    finally:
        mp.undo()


def segment(client: FleetClient, seg_id: str) -> Path:
    return client.shm().root / f"{seg_id}.arrow"


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``check()`` held; fails after ``timeout_s``."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.1)
    return time.monotonic() - t0


def sleep_until(epoch_s: float) -> None:
    time.sleep(max(0.0, epoch_s - time.time()))


def test_a_video_queued_longer_than_its_ttl_succeeds_and_goes_once_final(
    lstack: Any, lclient: FleetClient
) -> None:
    start_worker(lstack, "text")  # a janitor on the host; no video worker yet
    inputs = lclient.video_inputs(NASA)
    ref = inputs["video_ref"]
    handle = lclient.submit("video", inputs, priority="bulk")  # no deadline

    # Queued past its TTL and past two collections by the text worker's janitor, which
    # reclaims a segment at its TTL unless its lease was renewed.
    sleep_until(ref["created_at"] + TTL_S + 3 * JANITOR_S)
    assert segment(lclient, ref["id"]).exists(), "reclaimed while its request was queued"
    info = lclient.shm().info(ref["id"])
    assert info.request == handle.id  # bound to its request
    assert info.expires_at > time.time() + JANITOR_S  # renewed ahead of the next collection

    start_worker(lstack, "video")
    [outcome] = lclient.wait_all([handle], timeout_s=120)
    assert outcome is not None and "error" not in outcome, outcome
    assert outcome["result"]["frames"] >= 1
    assert time.time() - ref["created_at"] > TTL_S + 3 * JANITOR_S  # ran well past its TTL

    # Final, and never released by this client (wait_all reads outcomes only): the janitors
    # stop renewing it and it goes at the end of its last lease.
    final_at = time.time()
    path = segment(lclient, ref["id"])
    last_renewal = path.stat().st_mtime
    assert last_renewal <= final_at

    def gone_unrenewed() -> bool:
        try:
            assert path.stat().st_mtime == last_renewal, "renewed after its request was final"
        except FileNotFoundError:
            return True
        return False

    wait_until(gone_unrenewed, TTL_S + 3 * JANITOR_S + 2.0, "the finished input reclaimed")
    assert time.time() - final_at < TTL_S + 3 * JANITOR_S + 2.0


def test_a_video_queued_past_its_ttl_with_no_worker_on_the_host_runs_when_taken(
    lstack: Any, lclient: FleetClient
) -> None:
    inputs = lclient.video_inputs(NASA)
    ref = inputs["video_ref"]
    handle = lclient.submit("video", inputs, priority="bulk")
    sleep_until(ref["created_at"] + TTL_S + 1.0)
    # Nobody renewed it (no janitor ran) and nobody collected it: its lease lapsed.
    assert segment(lclient, ref["id"]).stat().st_mtime + TTL_S < time.time()

    # A video worker without a janitor: only its taking the request can renew the input.
    start_worker(lstack, "video", FLEET_TRANSPORT__JANITOR_INTERVAL_S="0")
    try:
        outcome = handle.outcome(timeout_s=120)
        assert "error" not in outcome, outcome
        assert outcome["result"]["frames"] >= 1
    finally:
        lclient.release_inputs(inputs)
    assert not segment(lclient, ref["id"]).exists()


def test_an_input_whose_request_never_runs_goes_at_the_lifetime_cap(
    lstack: Any, lclient: FleetClient
) -> None:
    start_worker(lstack, "text", FLEET_TRANSPORT__MAX_REF_LIFETIME_S=str(CAP_S))
    store = lclient.shm()
    # Bound to a request that is never sent (its producer died before sending it, say).
    ref = store.put(
        np.ones(100_000, np.uint8), detach=True, request_id=f"never-sent-{uuid.uuid4()}"
    )
    path = segment(lclient, ref.id)
    sleep_until(ref.created_at + TTL_S + 3 * JANITOR_S)
    assert path.exists(), "reclaimed at its TTL: its request never got a final result"
    sleep_until(ref.created_at + CAP_S - 2 * JANITOR_S)
    assert path.exists(), "reclaimed before the lifetime cap"
    wait_until(lambda: not path.exists(), 2 * CAP_S, "the orphan reclaimed")
    gone_after = time.time() - ref.created_at
    assert CAP_S <= gone_after < CAP_S + 3 * JANITOR_S + 2.0, gone_after


def fleet(*args: str) -> subprocess.CompletedProcess[str]:
    """``fleet ARGS`` as a user's shell would run it, with this module's ``FLEET_*``."""
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", *args],
        capture_output=True, text=True, env=dict(os.environ), cwd=REPO, timeout=120,
    )  # fmt: skip


def finished_video(stack: Any, client: FleetClient) -> Path:
    """A video request run to SUCCESS, its input never released, with a minute of lease left
    (no janitor on the host: only what the test runs collects)."""
    start_worker(stack, "video", FLEET_TRANSPORT__JANITOR_INTERVAL_S="0")
    inputs = client.video_inputs(NASA, ttl_s=60.0)
    handle = client.submit("video", inputs, priority="bulk")
    [outcome] = client.wait_all([handle], timeout_s=120)
    assert outcome is not None and "error" not in outcome, outcome
    path = segment(client, inputs["video_ref"]["id"])
    assert client.shm().info(path.stem).expires_at > time.time() + 30
    return path


def test_shm_gc_removes_the_inputs_of_finished_requests_and_lapsed_leases(
    lstack: Any, lclient: FleetClient
) -> None:
    finished = finished_video(lstack, lclient)
    store = lclient.shm()
    tiny = np.ones(1000, np.uint8)
    queued = store.put(tiny, detach=True, request_id=f"queued-{uuid.uuid4()}", ttl_s=60.0)
    lapsed = store.put(tiny, detach=True, request_id=f"lapsed-{uuid.uuid4()}", ttl_s=0.5)
    sleep_until(lapsed.created_at + 0.6)

    gc = fleet("shm", "gc")
    assert gc.returncode == 0, gc.stderr
    removed = gc.stdout.splitlines()[0].partition(": ")[2].split()
    assert sorted(removed) == sorted([finished.stem, lapsed.id]), gc.stdout
    assert "of which 1 the inputs of requests that are final" in gc.stdout
    assert not finished.exists()
    assert segment(lclient, queued.id).exists()  # its request may still run
    assert f"kept {queued.id} (1000 B): the input of request queued-" in gc.stdout


def test_fleet_down_removes_the_inputs_of_finished_requests_before_redis_stops(
    lstack: Any, lclient: FleetClient
) -> None:
    finished = finished_video(lstack, lclient)
    queued = lclient.shm().put(
        np.ones(1000, np.uint8), detach=True, request_id=f"queued-{uuid.uuid4()}", ttl_s=60.0
    )
    try:
        down = fleet("down")
        assert down.returncode == 0, down.stderr
        assert "redis" in down.stdout.splitlines()[0]
        assert not lstack.alive("redis")
        [shm] = [line for line in down.stdout.splitlines() if line.startswith("shm: removed")]
        assert "(1 the inputs of final requests)" in shm, down.stdout
        assert not finished.exists()
        # a queued request survives `fleet down` (Redis keeps its queue): so does its input
        assert segment(lclient, queued.id).exists()
    finally:
        lstack.up([], flower=False)  # Redis back for the other tests and the fixture's checks
