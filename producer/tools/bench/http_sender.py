"""A bench :class:`~producer.tools.bench.generator.Sender` that POSTs each request over HTTP.

Shared by the ``gateway`` mode (:class:`~producer.tools.bench.gateway.GatewaySender`) and the
``ray-serve`` peer (:class:`~producer.tools.bench.peers.sender.RaySender`). ``send`` hands each
request to one of ``threads`` threads, each holding a keep-alive ``http.client`` connection
per target (stdlib: a fraction of httpx's CPU per request, on the cores the workers need),
and returns at once: a fleet of HTTP clients, not one client waiting on each answer.
Requests beyond that many in flight wait in the pool; their latency still counts from their
scheduled time. What an answer means is the subclass's :meth:`HttpSender.answered`.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from producer.tools.bench.generator import Sender
from producer.tools.bench.records import SEND_FAILED, Record
from producer.tools.bench.schedule import Planned

__all__ = ["HttpSender"]


class HttpSender(Sender):
    """POSTs from a thread pool; subclasses build the request and read the answer.

    Args:
        addresses: ``(host, port)`` per target key (a modality, or ``""`` for one server).
        threads: concurrent requests in flight.
        headers: sent with every request.
        timeout_s: a connection's socket timeout, seconds.
    """

    def __init__(
        self,
        *args: Any,
        addresses: dict[str, tuple[str, int]],
        threads: int,
        headers: dict[str, str],
        timeout_s: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.addresses = addresses
        self.headers = headers
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="bench-http")
        self._lock = threading.Lock()

    def close(self) -> None:
        """Let the requests in flight finish; stop the threads."""
        self._pool.shutdown(wait=True)

    def request(self, planned: Planned, rec: Record, inputs: Any) -> tuple[str, str, bytes] | None:
        """``(target key, path, body)`` for one request, or ``None`` after completing
        ``rec`` with its code (a request refused before it is sent)."""
        raise NotImplementedError

    def answered(self, rec: Record, status: int, data: bytes) -> None:
        """Read one answer (called on the posting thread the moment it arrives)."""
        raise NotImplementedError

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
            req = self.request(planned, rec, self.catalog.get(planned.source, planned.input_index))
            if req is not None:
                self._pool.submit(self._post, rec, *req)
        return out

    def _post(self, rec: Record, key: str, path: str, body: bytes) -> None:
        try:
            try:
                status, data = self._roundtrip(key, path, body)
            except (http.client.HTTPException, OSError):  # a keep-alive connection closed
                self._conns().pop(key, None)
                status, data = self._roundtrip(key, path, body)
        except (http.client.HTTPException, OSError):
            self.table.complete(rec.id, self.tb.now_ms(), False, SEND_FAILED)
            return
        with self._lock:
            self.sent += 1
        self.answered(rec, status, data)

    def _conns(self) -> dict[str, http.client.HTTPConnection]:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        return conns

    def _roundtrip(self, key: str, path: str, body: bytes) -> tuple[int, bytes]:
        conns = self._conns()
        conn = conns.get(key)
        if conn is None:
            host, port = self.addresses[key]
            conn = conns[key] = http.client.HTTPConnection(host, port, timeout=self.timeout_s)
        conn.request("POST", path, body, self.headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
