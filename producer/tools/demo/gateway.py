"""``make demo``'s gateway phase: a handful of real requests through ``fleet gateway``.

Texts (JSON, three priorities), an image (binary in and out), an image scored against its
caption and an unrelated one (xmodal: its own must score higher), an async text (202, then
``GET /v2/jobs/{id}``) and two refusals, over plain HTTP (urllib: the demo needs no HTTP
client library). Each one is checked: status, code, shapes, and the texts' embeddings
against the same texts sent directly.
"""

from __future__ import annotations

import base64
import json
import struct
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from producer.client import FleetClient

DATA = Path(__file__).resolve().parents[3] / "data"


def _call(
    url: str,
    token: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(
        url + path,
        data=body,
        method=method,
        headers={"Authorization": f"Bearer {token}", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _text_body(text: str, priority: int) -> bytes:
    return json.dumps(
        {
            "parameters": {"priority": priority},
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}],
        }
    ).encode()


class _Phase:
    """The calls made so far: how many, their latencies (ms) and the failed checks."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token
        self.failures: list[str] = []
        self.lat: list[float] = []
        self.sent = 0

    def check(self, cond: bool, what: str) -> None:
        if not cond:
            self.failures.append(what)

    def timed(self, *args: Any, **kw: Any) -> tuple[int, dict[str, str], bytes]:
        self.sent += 1
        t0 = time.perf_counter()
        out = _call(self.url, self.token, *args, **kw)
        self.lat.append((time.perf_counter() - t0) * 1000.0)
        return out


def _texts(ph: _Phase, client: FleetClient, texts: list[str]) -> None:
    """Three texts at three priorities, each embedding checked against the direct path's."""
    for prio, text in zip((1, 2, 3), texts[:3], strict=False):
        status, _, body = ph.timed("POST", "/v2/models/minilm/infer", _text_body(text, prio))
        ph.check(status == 200, f"text priority {prio}: {status} {body[:200]!r}")
        if status == 200:
            emb = np.asarray(json.loads(body)["outputs"][0]["data"], dtype=np.float32)
            direct = np.asarray(client.submit("text", {"text": text}).get(30)["embedding"])
            ph.check(float(emb @ direct) > 0.9999, f"text priority {prio}: differs from direct")


def _binary_image(ph: _Phase, img: bytes) -> None:
    """A PNG in the binary extension, a 1,280-float32 embedding back in binary."""
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "datatype": "BYTES",
                    "shape": [1],
                    "parameters": {"binary_data_size": len(img) + 4},
                }
            ],
            "outputs": [{"name": "embedding", "parameters": {"binary_data": True}}],
        }
    )
    status, hdrs, body = ph.timed(
        "POST",
        "/v2/models/efficientnet-lite0/infer",
        head.encode() + struct.pack("<I", len(img)) + img,
        {
            "Inference-Header-Content-Length": str(len(head)),
            "Content-Type": "application/octet-stream",
        },
    )
    hl = int({k.lower(): v for k, v in hdrs.items()}.get("inference-header-content-length", 0))
    ph.check(status == 200 and len(body) - hl == 1280 * 4, f"binary image: {status} {body[:200]!r}")


def _xmodal(ph: _Phase, img: bytes, model: str) -> None:
    """The coffee photo scored against two captions by the xmodal modality's model: two
    scores back, the coffee caption's the higher."""
    caps = ["A cup of coffee on a saucer.", "A red bus on a street."]
    xm = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "datatype": "BYTES",
                    "shape": [1],
                    "data": [base64.b64encode(img).decode()],
                },
                {"name": "texts", "datatype": "BYTES", "shape": [2], "data": caps},
            ]
        }
    ).encode()
    status, _, body = ph.timed("POST", f"/v2/models/{model}/infer", xm)
    outs = {o["name"]: o for o in json.loads(body).get("outputs", [])} if status == 200 else {}
    scores = outs.get("scores", {})
    ok = scores.get("shape") == [2] and scores["data"][0] > scores["data"][1]
    ph.check(ok, f"xmodal: {status} {body[:200]!r}")


def _async_text(ph: _Phase, text: str) -> None:
    """``Prefer: respond-async``: 202, then the job polled until it ends in SUCCESS."""
    status, _, body = ph.timed(
        "POST", "/v2/models/minilm/infer", _text_body(text, 4), {"Prefer": "respond-async"}
    )
    ph.check(status == 202, f"async text: {status} {body[:200]!r}")
    if status == 202:
        loc = json.loads(body)["location"]
        state = "PENDING"
        for _ in range(300):
            _, _, job = _call(ph.url, ph.token, "GET", loc)
            state = json.loads(job)["state"]
            if state in ("SUCCESS", "FAILURE", "REVOKED"):
                break
            time.sleep(0.05)
        ph.check(state == "SUCCESS", f"async text ended {state}")


def _refusals(ph: _Phase) -> None:
    """A blank text (400 INVALID_INPUT) and an unknown model (404 MODEL_NOT_FOUND)."""
    for path, body, want in (
        ("/v2/models/minilm/infer", _text_body("   ", 3), (400, "INVALID_INPUT")),
        ("/v2/models/nope/infer", _text_body("x", 3), (404, "MODEL_NOT_FOUND")),
    ):
        status, _, out = ph.timed("POST", path, body)
        got = (status, json.loads(out).get("code"))
        ph.check(got == want, f"{path}: {got}, expected {want}")


def run_gateway(url: str, token: str, client: FleetClient, texts: list[str]) -> dict[str, Any]:
    """Send the gateway phase; returns ``{"sent", "failed", "failures", "latency_ms"}``."""
    ph = _Phase(url, token)
    _texts(ph, client, texts)
    img = (DATA / "images" / "skimage_coffee.png").read_bytes()
    _binary_image(ph, img)
    _xmodal(ph, img, client.settings.modality("xmodal").model)
    _async_text(ph, texts[3])
    _refusals(ph)
    lat = ph.lat
    return {
        "sent": ph.sent,
        "failed": len(ph.failures),
        "failures": ph.failures,
        "latency_ms": {"p50": round(float(np.median(lat)), 2), "max": round(max(lat), 2)},
    }
