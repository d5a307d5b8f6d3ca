"""``celery_task_sent_total`` for ``fleet exporter``, counted from producers' ``task-sent``
events (what celery-exporter does): a worker never sees a request that was not delivered.

The tap subscribes to the ``task.sent`` routing key only, so workers' grouped events do not
reach it. Labels: ``name`` (task), ``hostname`` (the producer's host: Celery names a producer
``gen<pid>@<host>``, and the pid part would grow the label set with every producer process)
and ``queue_name`` (a fleet queue, else ``other``). Requests published through the HTTP
gateway send no ``task-sent`` event (``producer.client.wire``) and are not counted here; the
workers' ``celery_task_received_total`` counts them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from celery import Celery
from celery.events.receiver import EventReceiver
from prometheus_client import CollectorRegistry

from shared.metrics.series import OTHER_QUEUE, make, of

log = logging.getLogger("fleet.exporter")

_RETRY_S = 2.0  # after a lost connection


class SentTap(threading.Thread):
    """Counts ``task-sent`` events into ``celery_task_sent_total`` of ``registry``.

    Args:
        app: a Celery app as the ``operator`` Redis user; queues: the fleet's queue names.
    """

    def __init__(self, app: Celery, registry: CollectorRegistry, queues: list[str]) -> None:
        super().__init__(name="exporter-sent-tap", daemon=True)
        self.app = app
        self.queues = set(queues)
        self.sent = make(of("exporter")["task_sent"], registry)
        self._stop = threading.Event()

    def on_sent(self, event: dict[str, Any]) -> None:
        queue = event.get("queue") or event.get("routing_key")
        host = str(event.get("hostname") or "").rpartition("@")[2] or "unknown"
        self.sent.labels(
            str(event.get("name") or "unknown"),
            host,
            queue if queue in self.queues else OTHER_QUEUE,
        ).inc()

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                with self.app.connection_for_read() as conn:
                    recv = EventReceiver(
                        conn, handlers={"task-sent": self.on_sent}, routing_key="task.sent",
                        app=self.app,
                    )  # fmt: skip
                    self._receiver = recv
                    recv.capture(limit=None, timeout=None, wakeup=False)
            except Exception as exc:  # Redis restarts: reconnect and go on counting
                log.warning("task-sent tap: %s; reconnecting in %.0f s", exc, _RETRY_S)
                time.sleep(_RETRY_S)
