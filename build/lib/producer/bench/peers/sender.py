"""The bench's sender for the ``ray-serve`` peer: each request a synchronous HTTP POST.

Ray Serve answers on the connection that asked (no queue, no result store), so the record
is completed by the thread that posted it, at the moment the answer arrived. ``send`` hands
each request to one of ``connections`` threads (each a keep-alive ``http.client``
connection: a fleet of HTTP clients, not one client waiting on each answer) and returns at
once; requests beyond that many in flight wait in the pool, and their latency counts from
their scheduled time as everywhere in the bench.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from producer.bench.generator import Sender
from producer.bench.records import SEND_FAILED, Record
from producer.bench.schedule import Planned
from shared.errors import FleetError

DEFAULT_CONNECTIONS = 64


class RaySender(Sender):
    """A :class:`Sender` that POSTs ``{"request": envelope}`` to the Ray Serve peer.

    Args:
        urls: the peer's base URL (``PeerProcess.url``) per modality; the route is ``/infer``.
        connections: concurrent requests in flight (default ``FLEET_BENCH_RAY_CONNECTIONS``
            or 64).
    """

    def __init__(
        self, *args: Any, urls: dict[str, str], connections: int | None = None, **kw: Any
    ) -> None:
        super().__init__(*args, **kw)
        self.addresses = {}
        for modality, url in urls.items():
            parts = urlsplit(url)
            self.addresses[modality] = (parts.hostname or "127.0.0.1", parts.port or 80)
        n = connections or int(os.environ.get("FLEET_BENCH_RAY_CONNECTIONS", DEFAULT_CONNECTIONS))
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="bench-ray")
        self._lock = threading.Lock()

    def close(self) -> None:
        """Let the requests in flight finish; stop the threads."""
        self._pool.shutdown(wait=True)

    def send(
        self,
        items: list[tuple[Planned, float]],
        producer: object,
        on_done: Callable[[Record], None] | None = None,
    ) -> list[Record]:
        out: list[Record] = []
        for planned, sched_s in items:
            rec = self.record(planned, sched_s, on_done)
            out.append(rec)
            inputs = self.catalog.get(planned.source, planned.input_index)
            try:
                env = self.client.envelope(
                    planned.modality, inputs, planned.priority, rec.timeout_s
                )
            except FleetError as exc:
                self.table.complete(rec.id, self.tb.now_ms(), False, exc.code)
                continue
            body = json.dumps({"request": env.model_dump(mode="json")}).encode()
            self._pool.submit(self._post, rec, planned.modality, body)
        return out

    def _post(self, rec: Record, modality: str, body: bytes) -> None:
        with self._lock:
            self.sent += 1
        try:
            try:
                status, data = self._roundtrip(modality, body)
            except (http.client.HTTPException, OSError):  # a keep-alive connection closed
                self._conns().pop(modality, None)
                status, data = self._roundtrip(modality, body)
        except (http.client.HTTPException, OSError):
            self.table.complete(rec.id, self.tb.now_ms(), False, SEND_FAILED)
            return
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

    def _conns(self) -> dict[str, http.client.HTTPConnection]:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        return conns

    def _roundtrip(self, modality: str, body: bytes) -> tuple[int, bytes]:
        conns = self._conns()
        conn = conns.get(modality)
        if conn is None:
            host, port = self.addresses[modality]
            conn = conns[modality] = http.client.HTTPConnection(host, port, timeout=120)
        conn.request("POST", "/infer", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
