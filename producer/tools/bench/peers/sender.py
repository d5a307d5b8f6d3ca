"""The bench's sender for the ``ray-serve`` peer: each request a synchronous HTTP POST.

Ray Serve answers on the connection that asked (no queue, no result store), so the record
is completed by the thread that posted it, at the moment the answer arrived. ``send`` hands
each request to one of ``connections`` threads (each a keep-alive ``http.client``
connection: a fleet of HTTP clients, not one client waiting on each answer) and returns at
once; requests beyond that many in flight wait in the pool, and their latency counts from
their scheduled time as everywhere in the bench.
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import urlsplit

from producer.tools.bench.http_sender import HttpSender
from producer.tools.bench.records import Record
from producer.tools.bench.schedule import Planned
from shared.errors import FleetError

DEFAULT_CONNECTIONS = 64


class RaySender(HttpSender):
    """An :class:`~producer.tools.bench.http_sender.HttpSender` that POSTs ``{"request": envelope}``
    to the Ray Serve peer and completes each record from its answer.

    Args:
        urls: the peer's base URL (``PeerProcess.url``) per modality; the route is ``/infer``.
        connections: concurrent requests in flight (default ``FLEET_BENCH_RAY_CONNECTIONS``
            or 64).
    """

    def __init__(
        self, *args: Any, urls: dict[str, str], connections: int | None = None, **kw: Any
    ) -> None:
        addresses = {}
        for modality, url in urls.items():
            parts = urlsplit(url)
            addresses[modality] = (parts.hostname or "127.0.0.1", parts.port or 80)
        n = connections or int(os.environ.get("FLEET_BENCH_RAY_CONNECTIONS", DEFAULT_CONNECTIONS))
        super().__init__(
            *args,
            addresses=addresses,
            threads=n,
            headers={"Content-Type": "application/json"},
            timeout_s=120.0,
            **kw,
        )

    def request(self, planned: Planned, rec: Record, inputs: Any) -> tuple[str, str, bytes] | None:
        try:
            env = self.client.envelope(planned.modality, inputs, planned.priority, rec.timeout_s)
        except FleetError as exc:
            self.table.complete(rec.id, self.tb.now_ms(), False, exc.code)
            return None
        body = json.dumps({"request": env.model_dump(mode="json")}).encode()
        return planned.modality, "/infer", body

    def answered(self, rec: Record, status: int, data: bytes) -> None:
        done_ms = self.tb.now_ms()
        try:
            answer = json.loads(data) if status == 200 else {}
        except ValueError:
            answer = {}
        if "result" in answer:
            self.table.complete(rec.id, done_ms, True, None)
        else:
            code = (answer.get("error") or {}).get("code") or f"HTTP_{status}"
            self.table.complete(rec.id, done_ms, False, str(code))
