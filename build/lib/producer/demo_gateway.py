"""``make demo``'s gateway phase: a handful of real requests through ``fleet gateway``.

Texts (JSON, three priorities), an image (binary in and out), an image scored against its
captions (xmodal), an async text (202, then ``GET /v2/jobs/{id}``) and two refusals, over
plain HTTP (urllib: the demo needs no HTTP client library). Each one is checked: status, code,
shapes, and the texts' embeddings against the same texts sent directly.
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

DATA = Path(__file__).resolve().parent.parent / "data"


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


def run_gateway(url: str, token: str, client: FleetClient, texts: list[str]) -> dict[str, Any]:
    """Send the gateway phase; returns ``{"sent", "failed", "failures", "latency_ms"}``."""
    failures: list[str] = []
    lat: list[float] = []
    sent = 0

    def check(cond: bool, what: str) -> None:
        if not cond:
            failures.append(what)

    def timed(*args: Any, **kw: Any) -> tuple[int, dict[str, str], bytes]:
        nonlocal sent
        sent += 1
        t0 = time.perf_counter()
        out = _call(url, token, *args, **kw)
        lat.append((time.perf_counter() - t0) * 1000.0)
        return out

    for prio, text in zip((1, 2, 3), texts[:3], strict=False):
        status, _, body = timed("POST", "/v2/models/minilm/infer", _text_body(text, prio))
        check(status == 200, f"text priority {prio}: {status} {body[:200]!r}")
        if status == 200:
            emb = np.asarray(json.loads(body)["outputs"][0]["data"], dtype=np.float32)
            direct = np.asarray(client.submit("text", {"text": text}).get(30)["embedding"])
            check(float(emb @ direct) > 0.9999, f"text priority {prio}: differs from direct")
    img = (DATA / "images" / "skimage_coffee.png").read_bytes()
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
    status, hdrs, body = timed(
        "POST",
        "/v2/models/resnet18-random/infer",
        head.encode() + struct.pack("<I", len(img)) + img,
        {
            "Inference-Header-Content-Length": str(len(head)),
            "Content-Type": "application/octet-stream",
        },
    )
    hl = int({k.lower(): v for k, v in hdrs.items()}.get("inference-header-content-length", 0))
    check(status == 200 and len(body) - hl == 512 * 4, f"binary image: {status} {body[:200]!r}")
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
    status, _, body = timed("POST", "/v2/models/xmodal-vit-minilm/infer", xm)
    ok = status == 200 and json.loads(body)["outputs"][0]["shape"] == [2]
    check(ok, f"xmodal: {status} {body[:200]!r}")
    status, hdrs, body = timed(
        "POST", "/v2/models/minilm/infer", _text_body(texts[3], 4), {"Prefer": "respond-async"}
    )
    check(status == 202, f"async text: {status} {body[:200]!r}")
    if status == 202:
        loc = json.loads(body)["location"]
        state = "PENDING"
        for _ in range(300):
            _, _, job = _call(url, token, "GET", loc)
            state = json.loads(job)["state"]
            if state in ("SUCCESS", "FAILURE", "REVOKED"):
                break
            time.sleep(0.05)
        check(state == "SUCCESS", f"async text ended {state}")
    for path, body, want in (
        ("/v2/models/minilm/infer", _text_body("   ", 3), (400, "INVALID_INPUT")),
        ("/v2/models/nope/infer", _text_body("x", 3), (404, "MODEL_NOT_FOUND")),
    ):
        status, _, out = timed("POST", path, body)
        got = (status, json.loads(out).get("code"))
        check(got == want, f"{path}: {got}, expected {want}")
    return {
        "sent": sent,
        "failed": len(failures),
        "failures": failures,
        "latency_ms": {"p50": round(float(np.median(lat)), 2), "max": round(max(lat), 2)},
    }
