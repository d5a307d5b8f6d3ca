"""Several hosts for real: Redis, workers and a producer in different network namespaces.

Each "host" is a network namespace of this machine joined to the root namespace by a veth
pair with link-local addresses the test assigns (169.254.x.y, nothing else is addressed):

- the root namespace is the Redis host (Redis bound to its veth address only, ACL users on);
- ``W`` runs the text, image and video workers, with a /dev/shm root of its own (its host's
  view of shared memory) and ``[transport] shared_host = false``;
- ``P`` runs a producer (``FleetClient``) with another shm root.

What must hold: text, image and video requests from ``P`` succeed on ``W``; the video file
(above the shm threshold) travels inline through Redis (the cross-host path) and so do the
video worker's output tensors; and a producer that wrongly believes it shares /dev/shm with
the workers gets a coded ``TENSOR_REF_INVALID`` for its shm reference, never a wrong read.
The namespaces, veth pairs and shm roots are removed afterwards.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DATA

pytestmark = pytest.mark.integration

PRODUCER = r"""
import json, sys
from producer.client import FleetClient, image_inputs
from shared.errors import FleetError
from shared.settings import load_settings

video = sys.argv[1]
image = sys.argv[2]
out = {}
c = FleetClient.from_settings()
out["text_dim"] = c.submit("text", {"text": "A message from another host."}).get(120)["dim"]
out["image_dim"] = c.submit("image", image_inputs(image)).get(120)["dim"]
inputs = c.video_inputs(video)
out["video_inputs"] = sorted(inputs)
res = c.submit("video", inputs).get(240)
out["video_frames"] = int(res["frame_embeddings"].shape[0])
out["video_dim"] = res["dim"]
# A producer configured as if it shared /dev/shm with the workers: its ref names a segment
# in its own host's shm root, which the worker's host does not have.
same_host = FleetClient(load_settings(transport={"shared_host": True}))
ref_inputs = same_host.video_inputs(video)
out["ref_inputs"] = sorted(ref_inputs)
try:
    same_host.submit("video", ref_inputs).get(240)
    out["ref_outcome"] = "SUCCESS"
except FleetError as exc:
    out["ref_outcome"] = exc.code
    out["ref_message"] = str(exc)
same_host.release_inputs(ref_inputs)
print("RESULT " + json.dumps(out))
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


class Hosts:
    """Two namespaces (``w``, ``p``) linked to the root namespace by veth pairs."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 10000}{random.randint(0, 99):02d}"
        self.ns = {"w": f"mmft-w{tag}", "p": f"mmft-p{tag}"}
        self.links = {"w": f"mmw{tag}", "p": f"mmp{tag}"}
        # two free /24s of 169.254.0.0/16 (never 169.254.0.x or .255.x, reserved)
        base = random.randint(20, 200)
        self.net = {"w": f"169.254.{base}", "p": f"169.254.{base + 1}"}
        self.redis_host = f"{self.net['w']}.1"

    def up(self) -> None:
        for h in ("w", "p"):
            ns, link, net = self.ns[h], self.links[h], self.net[h]
            _ip("netns", "add", ns)
            _ip("link", "add", f"{link}a", "type", "veth", "peer", "name", f"{link}b")
            _ip("link", "set", f"{link}b", "netns", ns)
            _ip("addr", "add", f"{net}.1/24", "dev", f"{link}a")
            _ip("link", "set", f"{link}a", "up")
            _ip("-n", ns, "addr", "add", f"{net}.2/24", "dev", f"{link}b")
            _ip("-n", ns, "link", "set", f"{link}b", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        # P reaches the Redis host's address on W's link through the root namespace
        _ip(
            "-n", self.ns["p"], "route", "add", f"{self.net['w']}.0/24", "via", f"{self.net['p']}.1"
        )

    def down(self) -> None:
        for h in ("w", "p"):
            subprocess.run(["ip", "link", "del", f"{self.links[h]}a"], capture_output=True)
            subprocess.run(["ip", "netns", "del", self.ns[h]], capture_output=True)

    def argv(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[host], *argv]


def _netns_usable() -> str | None:
    if sys.platform != "linux" or shutil.which("ip") is None:
        return "needs Linux and iproute2's ip"
    probe = f"mmft-probe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create network namespaces here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    reason = _netns_usable()
    if reason:
        pytest.skip(reason)
    h = Hosts()
    try:
        h.up()
        yield h
    finally:
        h.down()
        assert not [n for n in h.ns.values() if n in subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True).stdout]  # fmt: skip


@pytest.fixture(scope="module")
def fleet(hosts: Hosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from producer.stack.local import Stack, isolated_environment

    roots = {h: Path(f"/dev/shm/mmfleet-test-{hosts.ns[h]}") for h in ("w", "p")}
    overrides = {
        "FLEET_REDIS__HOST": hosts.redis_host,
        "FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE": "8",
        "FLEET_MODALITIES__IMAGE__BATCHING__MAX_BATCH_SIZE": "2",
    }
    with isolated_environment(tmp_path_factory.mktemp("multihost"), overrides) as settings:
        st = Stack(settings)
        st.prepare()
        try:
            st.start_redis()  # in the root namespace, bound to the W link's address only
            env_w = {
                **st.env(),
                "FLEET_TRANSPORT__SHM_ROOT": str(roots["w"]),
                "FLEET_TRANSPORT__SHARED_HOST": "false",
            }
            node = socket.gethostname()
            for m in ("text", "image", "video"):
                argv = hosts.argv("w", st.worker_argv(m))
                st.start_process(
                    f"worker-{m}",
                    argv,
                    lambda m=m: st.worker_ping(f"{m}@{node}"),
                    st.s.stack.ready_timeout_s,
                    env=env_w,
                )
            yield {"stack": st, "roots": roots}
        finally:
            st.down()
            for root in roots.values():
                shutil.rmtree(root, ignore_errors=True)


def test_requests_cross_hosts_and_a_same_host_ref_is_refused(
    hosts: Hosts, fleet: dict[str, Any]
) -> None:
    st, roots = fleet["stack"], fleet["roots"]
    # Redis listens on the W link only: not on loopback, where a same-host shortcut could hide
    listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout
    assert f"{hosts.redis_host}:{st.s.redis.port}" in listening
    assert f"127.0.0.1:{st.s.redis.port}" not in listening

    env_p = {
        **st.env(),
        "FLEET_TRANSPORT__SHM_ROOT": str(roots["p"]),
        "FLEET_TRANSPORT__SHARED_HOST": "false",
    }
    video = DATA / "videos" / "torchcodec_nasa_13013.mp4"  # 657 KB: above the shm threshold
    image = DATA / "images" / "pillow_hopper.jpg"
    proc = subprocess.run(
        hosts.argv("p", [sys.executable, "-c", PRODUCER, str(video), str(image)]),
        capture_output=True, text=True, timeout=600, env=env_p, cwd=str(Path(__file__).parents[2]),
    )  # fmt: skip
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(line[len("RESULT ") :])

    assert out["text_dim"] == 384 and out["image_dim"] == 1280
    assert out["video_inputs"] == ["video_b64"]  # the cross-host path: inline through Redis
    assert out["video_frames"] >= 1 and out["video_dim"] == 1280
    assert out["ref_inputs"] == ["video_ref"]
    assert out["ref_outcome"] == "TENSOR_REF_INVALID", out
    # each host's shm root: the producer's ref was written on P, nothing of it on W
    assert not roots["w"].exists() or not any(roots["w"].glob("*.arrow"))
