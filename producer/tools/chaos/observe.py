"""Watch a scenario's requests: final-state publishes, polled outcomes, workers' log lines."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import redis

from producer.client import FleetClient, ResultHandle, outcome_from_meta
from shared import schema

FINAL_STATES = {"SUCCESS", "FAILURE", "REVOKED"}
_RUN_LINE = re.compile(rb"request id=([0-9a-f-]{36}) state=(SUCCESS|FAILURE)\b")


class Publishes:
    """Counts final-state publishes per task id on the result channels (a thread).

    Every final result the workers store is published on its key's channel (Celery's Redis
    backend does the same); a request whose final state is published twice had two final
    results that a subscribed client could both see.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.counts: Counter[str] = Counter()
        self._r = client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-pubsub", daemon=True)
        self._ready = threading.Event()

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(5)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        prefix = schema.RESULT_KEY_PREFIX.encode()
        while not self._stop.is_set():
            try:
                ps = self._r.pubsub(ignore_subscribe_messages=True)
                ps.psubscribe(schema.RESULT_KEY_PREFIX + "*")
                self._ready.set()
                while not self._stop.is_set():
                    msg = ps.get_message(timeout=0.2)
                    if msg and msg["type"] == "pmessage":
                        self._count(msg["channel"][len(prefix) :].decode(), msg["data"])
            except redis.RedisError:  # Redis restarted (a scenario): subscribe again
                time.sleep(0.2)

    def _count(self, task_id: str, data: bytes) -> None:
        try:
            status = json.loads(data).get("status")
        except (ValueError, AttributeError):
            return
        if status in FINAL_STATES:
            self.counts[task_id] += 1


class Runs:
    """Counts finished runs per task id from the workers' log lines, from a starting point."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self._offsets: dict[Path, int] = {}

    def mark(self) -> None:
        """Start counting from now (remember every log's size)."""
        self._offsets = {p: p.stat().st_size for p in self.logs.glob("worker-*.log")}

    def counts(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for p in self.logs.glob("worker-*.log"):
            with p.open("rb") as f:
                f.seek(self._offsets.get(p, 0))
                for m in _RUN_LINE.finditer(f.read()):
                    out[m.group(1).decode()] += 1
        return out


def poll_outcomes(client: FleetClient, ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The final outcome of each id that has one (one round trip per 500 ids)."""
    ids = list(ids)
    backend = client.app.backend
    out: dict[str, dict[str, Any]] = {}
    for i in range(0, len(ids), 500):
        chunk = ids[i : i + 500]
        try:
            raw = backend.client.mget([backend.get_key_for_task(t) for t in chunk])
        except redis.RedisError:
            return out
        for tid, value in zip(chunk, raw, strict=True):
            if value is None:
                continue
            meta = backend.meta_from_decoded(backend.decode_result(value))
            if meta.get("status") in FINAL_STATES:
                out[tid] = outcome_from_meta(meta)
    return out


def handles_ids(handles: Iterable[ResultHandle]) -> list[str]:
    return [h.id for h in handles]


def locate(r: redis.Redis, task_ids: Iterable[str]) -> dict[str, str]:
    """Where each (lost) task id is now: a queue's priority list, kombu's unacked hash with
    its lease's age, or nowhere in Redis. For reading a failed run."""
    want = {t.encode(): t for t in task_ids}
    where = dict.fromkeys(want.values(), "nowhere")
    for key in r.scan_iter(count=1000):
        kind = r.type(key)
        if kind == b"list":
            for item in r.lrange(key, 0, -1):
                for raw, tid in want.items():
                    if raw in item:
                        where[tid] = f"queued in {key!r}"
    scores = dict(r.zrange(schema.UNACKED_INDEX_KEY, 0, -1, withscores=True))
    for tag, entry in r.hgetall(schema.UNACKED_KEY).items():
        for raw, tid in want.items():
            if raw in entry:
                age = time.time() - scores[tag] if tag in scores else None
                where[tid] = f"unacked tag={tag.decode()} lease_age_s={age}"
    return where
