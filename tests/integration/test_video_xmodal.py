"""Video and cross-modal workers end to end: real Redis, real workers, /dev/shm, Flower.

Runs on the session stack (``tests/conftest.py``) plus a video and an xmodal worker started
here, with their own shared-memory root so that "/dev/shm is back to its baseline" is exact
even while other tests use the default root.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.request import Request, urlopen

import numpy as np
import pytest

from producer.client import FleetClient, SubmitRequest, xmodal_inputs
from shared import schema
from shared.errors import FleetError
from shared.schema import Priority
from tests.conftest import ops_app

pytestmark = pytest.mark.integration
DATA = Path(__file__).resolve().parents[2] / "data"
NASA = DATA / "videos" / "torchcodec_nasa_13013.mp4"
MAX_MESSAGE_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def fleet(stack: Any) -> Iterator[tuple[FleetClient, Path]]:
    """A video and an xmodal worker on the session stack; a client sharing their shm root."""
    from shared.settings import load_settings

    shm_root = Path(f"/dev/shm/mmfleet-it-{os.getuid()}-{secrets.token_hex(4)}")
    mp = pytest.MonkeyPatch()
    for k, v in {
        "FLEET_TRANSPORT__SHM_ROOT": str(shm_root),
        # 8 fps, at most 32 frames: the NASA clip's first 4 s, about 2 s of CPU work in 4
        # frame mini-batches: long enough to watch its progress in Flower.
        "FLEET_MODELS__VIDEO-EFFICIENTNET-LITE0__SAMPLE_FPS": "8",
        "FLEET_MODELS__VIDEO-EFFICIENTNET-LITE0__MAX_FRAMES": "32",
        "FLEET_MODALITIES__XMODAL__BATCHING__MAX_BATCH_SIZE": "2",  # shorter warmup
    }.items():
        mp.setenv(k, v)
    try:
        with ThreadPoolExecutor(2) as pool:  # both load their models at the same time
            started = [pool.submit(stack.start_worker, m) for m in ("video", "xmodal")]
            for f in started:
                f.result()
        client = FleetClient(load_settings())
        assert client.settings.transport.shm_root == shm_root
        yield client, shm_root
        client.close()
    finally:
        with ThreadPoolExecutor(2) as pool:  # Celery's warm shutdown takes a few seconds
            list(pool.map(stack.stop, ["worker-video", "worker-xmodal"]))
        mp.undo()
        left = sorted(p.name for p in shm_root.glob("*")) if shm_root.exists() else []
        shutil.rmtree(shm_root, ignore_errors=True)
    assert left == [], f"segments left in {shm_root}: {left}"


def segments(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("*.arrow")) + sorted(
        p.name for p in root.glob(".tmp-*")
    )


def flower_get(stack: Any, path: str) -> dict[str, Any]:
    s = stack.s
    token = base64.b64encode(f"{s.flower.user}:{s.flower_password()}".encode()).decode()
    req = Request(f"{stack.flower_url()}{path}", headers={"Authorization": f"Basic {token}"})
    with urlopen(req, timeout=2) as r:
        return json.loads(r.read())


def video_nodes(client: FleetClient) -> list[str]:
    return [
        n
        for r in ops_app(client.settings).control.ping(timeout=1.0)
        for n in r
        if n.startswith("video@")
    ]


def test_video_through_shm_with_progress_in_flower(
    fleet: tuple[FleetClient, Path], stack: Any
) -> None:
    client, root = fleet
    assert segments(root) == []
    inputs = client.video_inputs(NASA)  # 657 KB: through /dev/shm
    assert set(inputs) == {"video_ref"} and inputs["video_ref"]["nbytes"] == NASA.stat().st_size
    assert len(segments(root)) == 1

    # The raw message on Redis, read before any worker takes it: small whatever the video.
    nodes = video_nodes(client)
    ops_app(client.settings).control.cancel_consumer("video", reply=True, destination=nodes)
    try:
        time.sleep(1.2)  # a BRPOP issued before the cancel times out after 1 s
        handle = client.submit("video", inputs)
        prio = Priority.parse("normal").celery_priority(client.settings)
        key = schema.priority_list_key("video", prio)
        with ops_app(client.settings).connection_for_write() as conn:
            queued = conn.default_channel.client.lrange(key, 0, -1)
        raw = [m for m in queued if handle.id.encode() in m]
    finally:
        ops_app(client.settings).control.add_consumer("video", reply=True, destination=nodes)
    assert len(raw) == 1, "the message was not in the queue"
    assert len(raw[0]) < 4096 < MAX_MESSAGE_BYTES, len(raw[0])

    # Progress while it runs: Flower's API (its event state) and the result backend.
    flower_seen: list[tuple[str, Any]] = []
    backend_seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + 90
    info: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            info = flower_get(stack, f"/api/task/info/{handle.id}")
            flower_seen.append((info.get("state"), info.get("result")))
        except Exception:
            info = {}
        meta = client.app.backend.get_task_meta(handle.id)
        if meta.get("status") == "PROGRESS":
            backend_seen.append(meta["result"])
        if info.get("state") == "SUCCESS":
            break
        time.sleep(0.05)
    assert info.get("state") == "SUCCESS", flower_seen[-5:]
    progress = [r for s, r in flower_seen if s == "PROGRESS"]
    assert progress, f"Flower never showed PROGRESS: {sorted(set(flower_seen), key=str)}"
    done_total = [tuple(map(int, r.split("/"))) for r in progress]
    assert all(t == 32 and 0 <= d <= 32 for d, t in done_total), done_total
    assert [d for d, _ in done_total] == sorted(d for d, _ in done_total)
    assert backend_seen and all(m["total"] == 32 for m in backend_seen), backend_seen

    # The stored result is small; get() resolves the TensorRef and releases both segments.
    stored = client.app.backend.client.get(client.app.backend.get_key_for_task(handle.id))
    assert len(stored) < MAX_MESSAGE_BYTES
    assert b'"kind": "shm"' in stored or b'"kind":"shm"' in stored
    result = handle.get(30)
    emb = result["frame_embeddings"]
    assert isinstance(emb, np.ndarray) and emb.shape == (32, 1280) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    clip = np.asarray(result["clip_embedding"])
    assert clip.shape == (1280,) and abs(np.linalg.norm(clip) - 1) < 1e-5
    assert result["frames"] == 32 and result["capped"] is True and result["partial"] is False
    assert segments(root) == []  # input released by the client, output released once mapped
    assert handle.get(1)["frames"] == 32  # a second get() returns the same resolved result


def test_bad_and_partial_videos(fleet: tuple[FleetClient, Path]) -> None:
    client, root = fleet
    bad = DATA / "videos" / "bad"
    files = [
        bad / "nasa_13013_truncated_300000B.mp4",  # no moov: cannot be opened
        bad / "torchcodec_av1_video_truncated_half.mkv",  # decodes 1.4 s of 5 s
        bad / "torchcodec_av1_video_truncated_3000B.mkv",  # opens, no frame decodes
        DATA / "videos" / "torchcodec_h264_10bits.mp4",  # fine
        bad / "mmaction2_test_truncated_half.avi",  # decodes 3.08 s of the 6.56 s declared
    ]
    reqs = [SubmitRequest("video", client.video_inputs(f)) for f in files]
    assert "video_ref" in reqs[0].inputs and "video_b64" in reqs[1].inputs
    handles = client.submit_many(reqs)
    with pytest.raises(FleetError) as err:
        handles[0].get(60)
    assert err.value.code == "VIDEO_DECODE"
    partial = handles[1].get(60)
    assert partial["partial"] is True and partial["frames"] == 11  # 1.4 s of 5 s at 8 fps
    assert partial["frame_embeddings"].shape == (11, 1280)
    with pytest.raises(FleetError) as err:
        handles[2].get(60)
    assert err.value.code == "VIDEO_DECODE"
    ok = handles[3].get(60)  # 34.7 KB: over the inline size, so it went through shm too
    assert "video_ref" in reqs[3].inputs and ok["frames"] == 8 and ok["partial"] is False
    avi = handles[4].get(60)  # 8 fps, at most 32 frames: 25 frames, 0.00-3.00 s
    assert avi["partial"] is True and avi["frames"] == 25
    assert "of the 6.56 s the header declares" in avi["partial_reason"]
    assert segments(root) == []


def test_xmodal_image_and_captions(fleet: tuple[FleetClient, Path]) -> None:
    client, root = fleet
    coco = json.loads((DATA / "captions" / "captions_coco.json").read_text())
    captions = [a["caption"] for a in coco["annotations"]]
    first = coco["images"][0]
    own = [a["caption"] for a in coco["annotations"] if a["image_id"] == first["id"]]
    h_own = client.submit("xmodal", xmodal_inputs(DATA / first["file_name"], own))
    h_all = client.submit("xmodal", xmodal_inputs(DATA / first["file_name"], captions))
    r_own, r_all = h_own.get(60), h_all.get(60)
    assert len(r_own["scores"]) == len(own) and len(r_all["scores"]) == len(captions) == 14
    assert r_all["text_embeddings"].shape == (14, 384)  # came back through shm
    img = np.asarray(r_all["image_embedding"])
    np.testing.assert_allclose(r_all["text_embeddings"] @ img, r_all["scores"], atol=1e-5)
    # The same image and captions score the same alone or among others.
    np.testing.assert_allclose(r_own["scores"], r_all["scores"][: len(own)], atol=1e-5)
    assert sum(r_all["probs"]) == pytest.approx(1.0)
    assert segments(root) == []
    with pytest.raises(FleetError) as err:
        client.submit("xmodal", {"image_b64": "aGk=", "texts": ["a"]}).get(30)
    assert err.value.code == "IMAGE_DECODE"


def test_cli_submit_video_and_xmodal(fleet: tuple[FleetClient, Path]) -> None:
    _, root = fleet
    cli = [sys.executable, "-m", "producer.cli", "submit"]
    video = DATA / "videos" / "torchcodec_h264_10bits.mp4"
    image = DATA / "images" / "skimage_chelsea.png"
    procs = [  # both at once: most of their time is Python start-up
        subprocess.Popen(
            cli + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ),  # the session's and this module's FLEET_* settings
        )
        for args in (
            ["video", "--file", str(video)],
            ["xmodal", "--image", str(image), "--text", "A cat.", "--text", "A rocket."],
        )
    ]  # fmt: skip
    try:
        (v_out, v_err), (x_out, x_err) = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:  # never leave one running
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode == 0, v_err
    assert json.loads(v_out)["result"]["frame_embeddings"] == {
        "shape": [8, 1280],
        "dtype": "float32",
    }
    assert procs[1].returncode == 0, x_err
    assert len(json.loads(x_out)["result"]["scores"]) == 2
    assert segments(root) == []
