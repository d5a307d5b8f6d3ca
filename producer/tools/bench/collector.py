"""Result and event collection for the bench, each on its own thread and connection.

:class:`ResultCollector` subscribes to the result backend's own notifications: every result
the fleet stores (``workers/batching/completion.py``) and every result plain Celery stores
(``RedisBackend.set``) is a ``SETEX`` plus a ``PUBLISH`` on the result key. One
``PSUBSCRIBE celery-task-meta-*`` therefore sees each outcome as it is stored, with no polling
interval, and the latency itself comes from the stored ``date_done`` (the worker's clock at the
moment it wrote the result), not from when the bench happened to read it. Whatever the
subscription missed is read with one ``MGET`` at the end (:meth:`ResultCollector.sweep`).

:class:`EventTap` listens to Celery's task events for two facts results do not carry: when a
worker started a request (``task-started``) and how long its batch ran (``runtime`` of
``task-succeeded``; the fleet also names the batch size there).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from celery import Celery
from celery.events.receiver import EventReceiver

from producer.client import outcome_from_meta
from producer.tools.bench.records import RecordTable
from shared import schema

log = logging.getLogger("fleet.bench")
_READY = {"SUCCESS", "FAILURE", "REVOKED"}
_BATCH_SIZE = re.compile(r"""['"]batch_size['"]:\s*(\d+)""")


def parse_date_done_ms(value: Any) -> float | None:
    """``date_done`` (ISO 8601 with offset, or a datetime) as epoch milliseconds."""
    if isinstance(value, datetime):
        return value.timestamp() * 1000.0
    if isinstance(value, str) and value:
        return datetime.fromisoformat(value).timestamp() * 1000.0
    return None


def outcome_of(meta: dict[str, Any]) -> tuple[float | None, bool, str | None] | None:
    """``(done_ms, ok, code)`` of a stored result meta; ``None`` if not final yet."""
    if meta.get("status") not in _READY:
        return None
    out = outcome_from_meta(meta)
    done_ms = parse_date_done_ms(meta.get("date_done"))
    if "result" in out:
        return done_ms, True, None
    return done_ms, False, str(out["error"].get("code") or "FLEET_ERROR")


def batch_size_of(result_repr: Any) -> int | None:
    """The batch size in a fleet ``task-succeeded`` summary (``None`` for plain Celery)."""
    if not isinstance(result_repr, str):
        return None
    m = _BATCH_SIZE.search(result_repr)
    return int(m.group(1)) if m else None


class ResultCollector(threading.Thread):
    """Completes records in ``self.table`` as their results are stored (see module doc)."""

    def __init__(self, app: Celery, table: RecordTable) -> None:
        super().__init__(name="bench-results", daemon=True)
        self.backend = app.backend
        self.table = table  # swapped by the runner between repetitions
        self._stop_flag = threading.Event()
        self._pubsub = self.backend.client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.psubscribe(f"{schema.RESULT_KEY_PREFIX}*")
        self._prefix = len(schema.RESULT_KEY_PREFIX)

    def run(self) -> None:
        while not self._stop_flag.is_set():
            try:
                msg = self._pubsub.get_message(timeout=0.2)
            except Exception:  # connection lost: sweep() still reads what was stored
                log.warning("result subscription failed", exc_info=True)
                return
            if msg and msg.get("type") == "pmessage":
                self._handle(msg["channel"], msg["data"])

    def _handle(self, channel: bytes | str, data: bytes | str) -> None:
        key = channel.decode() if isinstance(channel, bytes) else channel
        try:
            meta = schema.decode_result(self.backend, data)
        except (ValueError, json.JSONDecodeError):
            return
        got = outcome_of(meta)
        if got is not None:
            self.table.complete(key[self._prefix :], *got)

    def sweep(self, ids: Sequence[str]) -> int:
        """Read stored results of ``ids`` directly (one MGET per 500); returns how many."""
        found = 0
        for i in range(0, len(ids), 500):
            chunk = list(ids[i : i + 500])
            raw = self.backend.client.mget([self.backend.get_key_for_task(t) for t in chunk])
            for task_id, value in zip(chunk, raw, strict=True):
                if value is None:
                    continue
                got = outcome_of(schema.decode_result(self.backend, value))
                if got is not None:
                    self.table.complete(task_id, *got)
                    found += 1
        return found

    def stop(self) -> None:
        self._stop_flag.set()
        self.join(timeout=5)
        try:
            self._pubsub.close()
        except Exception:
            log.debug("closing the result subscription failed", exc_info=True)


class _Receiver(EventReceiver):
    """An EventReceiver that keeps event timestamps as sent (epoch seconds, no tz shift)."""

    def event_from_message(self, body: Any, localize: bool = True, **kw: Any) -> Any:
        return super().event_from_message(body, localize=False, **kw)


class EventTap(threading.Thread):
    """Feeds ``task-started`` and ``task-succeeded`` events into ``self.table``."""

    def __init__(self, app: Celery, table: RecordTable) -> None:
        super().__init__(name="bench-events", daemon=True)
        self.table = table
        self._conn = app.connection_for_read()
        handlers: dict[str, Callable[[dict[str, Any]], None]] = {
            "task-started": self._on_started,
            "task-succeeded": self._on_succeeded,
        }
        self.receiver = _Receiver(self._conn, handlers=handlers, app=app)
        self.failed: BaseException | None = None

    def run(self) -> None:
        try:
            self.receiver.capture(limit=None, timeout=None, wakeup=False)
        except BaseException as exc:  # reported by the runner; results still count
            self.failed = exc
            log.warning("event tap stopped: %s", exc, exc_info=True)

    def _on_started(self, event: dict[str, Any]) -> None:
        ts = event.get("timestamp")
        if ts is not None:
            self.table.started(event["uuid"], float(ts) * 1000.0)

    def _on_succeeded(self, event: dict[str, Any]) -> None:
        runtime = event.get("runtime")
        self.table.succeeded(
            event["uuid"],
            None if runtime is None else float(runtime) * 1000.0,
            batch_size_of(event.get("result")),
        )

    def stop(self) -> None:
        self.receiver.should_stop = True
        self.join(timeout=5)
        try:
            self._conn.release()
        except Exception:
            log.debug("closing the event connection failed", exc_info=True)
