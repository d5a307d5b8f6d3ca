"""The ``redis-limit`` mode: the physical floor of one Redis for the fleet's message bytes.

No workers, no Celery, no processing: the exact messages the fleet's producer pushes for the
workload's requests (captured once through ``submit_many``, :func:`capture_messages`, as the
``submit-rate`` workload's ``raw`` path does) are pushed again and again with pipelined
``LPUSH`` (``CHUNK`` per pipeline, one connection, the producer's ACL user) from one thread and
popped with pipelined ``RPOP key count`` from another thread on a second connection (the
worker's ACL user), for the closed phase's duration. At most the phase's ``concurrency``
messages are queued at a time (a semaphore: a slot per message, freed by its pop), like the
closed loop. A popped message is one request done; the rate is pops per second over the same
window the other modes are accounted over (after ``warmup_s``, to the phase's end). The
``task-sent`` events the fleet's producer also publishes are not sent: this is the queue's
floor, not the producer's.

Both threads run in the bench process, so its CPU is the ``producer`` figure; Redis's CPU and
commands come from the same snapshots as every mode's (``accounting.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from producer.client import FleetClient, SubmitRequest
from producer.tools.bench.accounting import Accountant, WindowSampler, load_window
from producer.tools.bench.capture import CHUNK, capture_messages, list_keys
from producer.tools.bench.schedule import ClosedPicker
from producer.tools.bench.sources import InputCatalog
from producer.tools.bench.workload import Workload
from shared.redis_client import redis_client
from shared.settings import Settings

__all__ = ["CAPTURE_MAX", "RedisLimit"]

CAPTURE_MAX = 2000  # distinct messages captured (pushed round-robin)
MODE = "redis-limit"


class RedisLimit:
    """One Redis's push/pop rate for the workload's messages; :meth:`repetition` per rep."""

    def __init__(self, w: Workload, catalog: InputCatalog, settings: Settings) -> None:
        self.w = w
        self.catalog = catalog
        self.settings = settings
        self.messages: list[tuple[str, bytes]] = []
        self.modalities: list[str] = []
        closed = [p for p in w.phases if p.arrival == "closed"]
        self.capacity = sum(int(p.concurrency or 1) for p in closed) or CHUNK * 10
        self.duration_s = max((p.start_s + (p.duration_s or 0.0) for p in w.phases), default=0.0)
        if self.duration_s <= 0:
            raise ValueError("redis-limit needs a phase with duration_s")

    def _requests(self) -> list[SubmitRequest]:
        modality_of = {k: self.catalog.modality(k) for k in self.w.sources}
        out: list[SubmitRequest] = []
        phases = [p for p in self.w.phases if p.arrival == "closed"] or self.w.phases
        pickers = [ClosedPicker(self.w, p, modality_of) for p in phases]
        n = min(CAPTURE_MAX, max(self.capacity, CHUNK))
        for i in range(n):
            p = pickers[i % len(pickers)].next(0.0)
            inputs = self.catalog.get(p.source, p.input_index)
            out.append(SubmitRequest(p.modality, inputs, p.priority, p.timeout_s))
        return out

    def capture(self, client: FleetClient, admin: Any) -> None:
        """The messages ``submit_many`` sends for the workload's first requests (once)."""
        if not self.messages:
            reqs = self._requests()
            self.modalities = sorted({r.modality for r in reqs})
            keys = list_keys(self.modalities)
            self.messages = capture_messages(client, admin, reqs, keys)

    def repetition(
        self, accountant: Accountant, idle: dict[str, Any] | None
    ) -> tuple[float, dict[str, Any]]:
        """Push and pop for the phase's duration; (pops per second, the accounting window)."""
        keys = sorted({k for k, _ in self.messages})
        push_conn = redis_client(self.settings, "producer")
        pop_conn = redis_client(self.settings, "worker")
        push_conn.ping()
        pop_conn.ping()
        slots = threading.Semaphore(self.capacity)
        stop = threading.Event()
        popped = [0]
        errors: list[BaseException] = []

        def guarded(fn: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                try:
                    fn()
                except BaseException as exc:
                    errors.append(exc)
                    stop.set()

            return run

        def push() -> None:
            msgs, i, n = self.messages, 0, len(self.messages)
            while not stop.is_set():
                pipe = push_conn.pipeline(transaction=False)
                for _ in range(CHUNK):
                    while not slots.acquire(timeout=0.05):
                        if stop.is_set():
                            break
                    if stop.is_set():
                        break
                    key, msg = msgs[i % n]
                    pipe.lpush(key, msg)
                    i += 1
                pipe.execute()

        def pop() -> None:
            while not stop.is_set():
                pipe = pop_conn.pipeline(transaction=False)
                for key in keys:
                    pipe.rpop(key, CHUNK)
                got = sum(len(x) for x in pipe.execute() if x)
                if got:
                    popped[0] += got
                    slots.release(got)
                else:
                    time.sleep(0.0005)

        t0 = time.monotonic() + 0.2
        start_s, end_s = load_window(self.w)
        sampler = WindowSampler(accountant, t0 + start_s, t0 + end_s, count=lambda: popped[0])
        threads = [
            threading.Thread(target=guarded(push), name="redis-limit-push", daemon=True),
            threading.Thread(target=guarded(pop), name="redis-limit-pop", daemon=True),
        ]
        sampler.start()
        while time.monotonic() < t0:
            time.sleep(0.01)
        for t in threads:
            t.start()
        sampler.join()
        stop.set()
        for t in threads:
            t.join(10.0)
        accountant.admin.delete(*keys)  # the admin's: the producer user may not DEL
        push_conn.close()
        pop_conn.close()
        if errors:
            raise RuntimeError(f"{MODE}: {errors[0]}")
        win = sampler.figures(idle)
        return win["rps"], win
