"""Traffic through the HTTP gateway for a chaos scenario, from clients that do what the
docs/gateway.md advises when an answer does not come: send the same request again, with the same id.

Each request gets an id of its own (``Idempotency-Key``) and is sent until the gateway
accepts it (200 with its result, 202, or the job's own final error): a connection refused or
reset (the gateway was killed, or is starting again), a 5xx or a 429 of the gateway is
answered by a pause and the same POST again. Half the requests wait for their result
(``Prefer: wait=10``: many are in flight when the gateway dies), half ask for 202 at once
(``respond-async``). :meth:`GatewayLoad.burst` sends many at once (a fault strikes while the
gateway creates them). Every id sent is counted, accepted or not: one that never got an
answer and never ran is lost.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

log = logging.getLogger("fleet.chaos")

PRIORITIES = ("bulk", "bulk", "normal", "high")
RETRY_PAUSE_S = 0.2  # after a refused connection or a 5xx (a 429's Retry-After wins)
GIVE_UP_S = 90.0  # a request not accepted by then is left (and counted lost if it never ran)
THREADS = 128  # clients: a burst's requests all reach the gateway together


@dataclass
class GatewayTally:
    """What the clients saw: ids sent (in order), attempts, answers by status."""

    sent: list[str] = field(default_factory=list)
    accepted: set[str] = field(default_factory=set)
    retried: set[str] = field(default_factory=set)  # ids sent more than once
    answers: Counter[str] = field(default_factory=Counter)  # "202", "503", "conn", ...
    inflight: int = 0  # requests sent and not answered, right now


class GatewayLoad:
    """``count`` text requests through the gateway at ``url`` at ``rate_per_s``, each sent
    until accepted (see the module docstring); ``finish`` waits for the last answer."""

    def __init__(
        self, url: str, token: str, texts: list[str], count: int, rate_per_s: float, seed: int
    ) -> None:
        self.url = f"{url}/v2/models/minilm/infer"
        self.token = token
        self.texts = texts
        self.count = count
        self.rate_per_s = rate_per_s
        self.tally = GatewayTally()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="chaos-gw")
        self._http = httpx.Client(
            timeout=httpx.Timeout(30.0, connect=2.0),
            limits=httpx.Limits(max_connections=THREADS, max_keepalive_connections=THREADS),
        )
        self._futures: list[Future[None]] = []
        self._thread = threading.Thread(target=self._run, name="chaos-gw-load", daemon=True)

    def start(self) -> GatewayLoad:
        self._thread.start()
        return self

    def in_flight(self) -> int:
        with self._lock:
            return self.tally.inflight

    def burst(self, n: int) -> None:
        """``n`` more requests at once (beyond ``count``): many creates in flight in the
        gateway at the moment a fault strikes, as under a real burst of traffic."""
        for _ in range(n):
            self._submit_one()

    def finish(self, timeout_s: float = GIVE_UP_S + 30.0) -> None:
        """Wait until every request was sent and answered (or given up), then close."""
        self._thread.join(timeout_s)
        end = time.monotonic() + timeout_s
        for f in list(self._futures):
            f.exception(timeout=max(end - time.monotonic(), 0.1))
        self._pool.shutdown(wait=True)
        self._http.close()

    def _run(self) -> None:
        t0 = time.monotonic()
        for i in range(self.count):
            time.sleep(max(t0 + i / self.rate_per_s - time.monotonic(), 0.0))
            self._submit_one()

    def _submit_one(self) -> None:
        with self._lock:
            i = len(self.tally.sent)
            task_id = f"gw-{uuid.uuid4()}"
            self.tally.sent.append(task_id)
            body = {
                "inputs": [
                    {
                        "name": "text",
                        "datatype": "BYTES",
                        "shape": [1],
                        "data": [self._rng.choice(self.texts)],
                    }
                ],
                "parameters": {"priority": self._rng.choice(PRIORITIES)},
            }
            prefer = "respond-async" if i % 2 else "wait=10"
            self._futures.append(self._pool.submit(self._send, task_id, body, prefer))

    def _send(self, task_id: str, body: dict[str, object], prefer: str) -> None:
        headers = {
            "Authorization": f"Bearer {self.token}",
            "Idempotency-Key": task_id,
            "Prefer": prefer,
        }
        give_up = time.monotonic() + GIVE_UP_S
        for attempt in itertools.count():
            if attempt:
                with self._lock:
                    self.tally.retried.add(task_id)
            with self._lock:
                self.tally.inflight += 1
            pause = RETRY_PAUSE_S
            try:
                r = self._http.post(self.url, json=body, headers=headers)
                answer = str(r.status_code)
                if r.status_code in (200, 202) or _job_answer(r, task_id):
                    with self._lock:  # the job's result, its 202, or its own final error
                        self.tally.accepted.add(task_id)
                        self.tally.answers[answer] += 1
                    return
                pause = float(r.headers.get("Retry-After", RETRY_PAUSE_S))
                if r.status_code < 500 and r.status_code != 429:  # refused input: not retried
                    log.warning("gateway refused %s: %s %s", task_id, answer, r.text[:200])
                    with self._lock:
                        self.tally.answers[answer] += 1
                    return
            except httpx.HTTPError as exc:
                answer = "conn" if isinstance(exc, httpx.TransportError) else type(exc).__name__
            finally:
                with self._lock:
                    self.tally.inflight -= 1
            with self._lock:
                self.tally.answers[answer] += 1
            if time.monotonic() + pause > give_up:
                log.warning("gave up on %s after %d attempts", task_id, attempt + 1)
                return
            time.sleep(min(pause, 2.0))


def _job_answer(r: httpx.Response, task_id: str) -> bool:
    """Whether an error answer is the job's own final outcome (a 504 ``DEADLINE_EXCEEDED``,
    a 500 ``MODEL_ERROR``: the body names the job), not the gateway's refusal to take it."""
    try:
        return bool(r.json().get("id") == task_id)
    except ValueError:
        return False
