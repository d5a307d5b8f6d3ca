"""The bench's ``gateway`` mode: the fleet's workload sent through the HTTP gateway.

``fleet bench text-saturate --modes fleet,gateway`` (``make bench WORKLOAD=text-saturate
MODES=fleet,gateway``) runs the same schedule twice on the same workers: ``fleet`` publishes
with ``FleetClient.publish`` (the direct path), ``gateway`` POSTs each request to a
``fleet gateway`` process (OIP JSON, the bench's task id as the request ``id``, ``Prefer:
respond-async``, from a pool of keep-alive connections) and the results are collected
from Redis exactly as for the direct path. So the throughput ratio compares the two ways in,
the gateway's HTTP parsing, admission, idempotency record and publish included; what the
gateway adds on the way out (waiting on the result, encoding the outputs) is measured by
:func:`measure_overhead`: requests one at a time on the idle worker, alternating the direct
Python path (``submit().get()``) and a synchronous gateway request, wall time at the client;
the overhead is the median of the paired differences.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

import httpx

from producer.client import FleetClient
from producer.tools.bench.http_sender import HttpSender
from producer.tools.bench.records import SEND_FAILED, Record
from producer.tools.bench.schedule import Planned

PRIORITY_LEVEL = {"realtime": 1, "high": 2, "normal": 3, "bulk": 4}  # the gateway's mapping
OVERHEAD_PROBES = 40


def oip_body(
    modality: str, inputs: dict[str, Any], task_id: str, priority: str, timeout_s: float | None
) -> dict[str, Any]:
    """An OIP inference request for the bench's text and image inputs (JSON; files base64)."""
    if modality == "text":
        tensor = {"name": "text", "datatype": "BYTES", "shape": [1], "data": [inputs["text"]]}
    elif modality == "image":
        tensor = {"name": "image", "datatype": "BYTES", "shape": [1], "data": [inputs["image_b64"]]}
    else:
        raise ValueError(f"the gateway mode sends text and image only, not {modality}")
    params: dict[str, Any] = {"priority": PRIORITY_LEVEL[priority]}
    if timeout_s:
        params["timeout"] = int(timeout_s * 1e6)
    return {"id": task_id, "parameters": params, "inputs": [tensor]}


class GatewaySender(HttpSender):
    """An :class:`~producer.tools.bench.http_sender.HttpSender` that POSTs to the gateway instead
    of publishing, from ``POST_THREADS`` threads. A refusal completes its record at once
    with the gateway's code; an accepted request completes when its result reaches Redis.

    Args:
        url: the gateway's base URL; token: its bearer token.
    """

    POST_THREADS = 8

    def __init__(self, *args: Any, url: str, token: str, **kwargs: Any) -> None:
        parts = urlsplit(url)
        super().__init__(
            *args,
            addresses={"": (parts.hostname or "127.0.0.1", parts.port or 80)},
            threads=self.POST_THREADS,
            headers={
                "Authorization": f"Bearer {token}",
                "Prefer": "respond-async",
                "Content-Type": "application/json",
            },
            timeout_s=60.0,
            **kwargs,
        )
        self.models = {m: c.model for m, c in self.client.settings.modalities.items()}

    def request(self, planned: Planned, rec: Record, inputs: Any) -> tuple[str, str, bytes]:
        body = oip_body(planned.modality, inputs, rec.id, planned.priority, rec.timeout_s)
        path = f"/v2/models/{self.models[planned.modality]}/infer"
        return "", path, json.dumps(body).encode()

    def answered(self, rec: Record, status: int, data: bytes) -> None:
        if status >= 400:  # refused up front: the caller sees the code at once
            code = json.loads(data).get("code", SEND_FAILED) if data else SEND_FAILED
            self.table.complete(rec.id, self.tb.now_ms(), False, code)


def measure_overhead(client: FleetClient, url: str, token: str, texts: list[str]) -> dict[str, Any]:
    """Idle latency, direct vs through the gateway (synchronous), one request at a time.

    Returns ``{"n", "direct_p50_ms", "gateway_p50_ms", "overhead_p50_ms"}``; the overhead is
    the median of per-pair differences (gateway minus direct, same text, back to back).
    """
    model = client.settings.modalities["text"].model
    timeout_s = 30.0  # a latency probe, not a deadline test: HIGH's 1 s would refuse a slow one
    direct: list[float] = []
    gateway: list[float] = []
    with httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30.0
    ) as h:
        for i in range(OVERHEAD_PROBES + 3):
            text = texts[i % len(texts)]
            t0 = time.perf_counter()
            client.submit("text", {"text": text}, "high", timeout_s).get(timeout_s)
            d = (time.perf_counter() - t0) * 1000.0
            body = oip_body("text", {"text": text}, f"ovh-{uuid.uuid4().hex}", "high", timeout_s)
            t0 = time.perf_counter()
            r = h.post(f"/v2/models/{model}/infer", json=body)
            g = (time.perf_counter() - t0) * 1000.0
            r.raise_for_status()
            if i >= 3:  # the first pairs warm connections and caches
                direct.append(d)
                gateway.append(g)
    return {
        "n": len(direct),
        "direct_p50_ms": round(statistics.median(direct), 2),
        "gateway_p50_ms": round(statistics.median(gateway), 2),
        "overhead_p50_ms": round(
            statistics.median(g - d for g, d in zip(gateway, direct, strict=True)), 2
        ),
    }
