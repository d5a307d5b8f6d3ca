"""Worker series under the names Celery and Triton operators already chart.

Celery (as ``danihodovic/celery-exporter`` names them, so its Grafana dashboards read a
fleet worker): ``celery_task_{received,started,succeeded,failed,retried,revoked}_total``
with ``name`` (the task: ``fleet.text``), ``hostname`` (the worker's node, ``text@host``)
and ``queue_name`` (``text`` or ``text.realtime``); ``celery_task_runtime`` (seconds, a
histogram, per request: its batch's run time); ``celery_worker_up``;
``celery_worker_tasks_active`` (requests in a running batch). ``celery_task_sent_total`` is
the producers' (``fleet exporter`` counts ``task-sent`` events).

Inference server (the shape of Triton's ``nv_inference_*``, per ``model`` and ``modality``):
``fleet_inference_request_success_total``, ``fleet_inference_request_failure_total{reason}``
(reason: the error code), ``fleet_inference_count_total`` (requests run) vs
``fleet_inference_exec_count_total`` (batches run: their ratio is the mean batch size),
``fleet_inference_pending_request_count`` (held in the prefetch window, not running), and
the ``queue`` (window arrival to batch start), ``compute`` (the batch's run time) and
``request`` (submit to result stored) durations as histograms, in seconds.

Label values are bounded: one task name, node and model per process, the modality's two
queues (anything else is ``other``), error codes from ``shared.errors``.
Per request the cost is a few in-process counter and histogram updates: no I/O. The series
themselves (names, help texts, labels, buckets) are the ``ecosystem`` rows of
``shared.metrics.series.SERIES``, each an attribute of :class:`EcosystemMetrics`
(``task_received`` ... ``task_revoked``, ``runtime``, ``success``, ``queue_s`` ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from shared import keys
from shared.metrics.series import TASK_EVENTS, make, of

__all__ = ["OTHER_QUEUE", "REVOKED", "EcosystemMetrics"]

OTHER_QUEUE = "other"
REVOKED = "REVOKED"


class EcosystemMetrics:
    """The Celery- and Triton-named series of one worker process.

    Args:
        registry: the worker's registry (``shared.metrics.FleetMetrics.registry``).
        modality: the worker's modality; model: its model's name; hostname: its node name.
    """

    def __init__(
        self, registry: CollectorRegistry, modality: str, model: str, hostname: str
    ) -> None:
        self.modality, self.model, self.hostname = modality, model, hostname
        self.task = keys.task_name(modality)
        self.queues = {keys.queue_name(modality), keys.realtime_queue_name(modality)}
        for attr, series in of("ecosystem").items():
            setattr(self, attr, make(series, registry))
        self._task_counters = {event: getattr(self, f"task_{event}") for event in TASK_EVENTS}
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self._active: Callable[[], float] | None = None
        self.worker_up.labels(hostname).set(1)

    def queue_label(self, routing_key: str | None) -> str:
        """The ``queue_name`` label of a message: one of this modality's queues, or ``other``
        (a bounded label set whatever a producer routes here)."""
        return routing_key if routing_key in self.queues else OTHER_QUEUE

    def queue_of(self, req: object) -> str:
        """The ``queue_name`` label of a Celery request (its delivery's routing key)."""
        info = getattr(req, "delivery_info", None)
        return self.queue_label(info.get("routing_key") if isinstance(info, dict) else None)

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: ``labels()`` validates and locks each call,
        the larger part of a request's metric cost."""
        key = (metric, labels)
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = metric.labels(*labels)
        return got

    def _task(self, event: str, queue: str) -> Any:
        return self.child(self._task_counters[event], self.task, self.hostname, queue)

    def zero(self, codes: list[str]) -> None:
        """Create every bounded counter series at 0 (see ``FleetMetrics._zero_counters``)."""
        m = (self.model, self.modality)
        for queue in sorted(self.queues):
            for event in self._task_counters:
                self._task(event, queue)
        self.success.labels(*m)
        for code in codes:
            self.failure.labels(*m, code)
        self.inference_count.labels(*m)
        self.exec_count.labels(*m)

    # -- hooks ---------------------------------------------------------------------------
    def received(self, queue: str) -> None:
        self._task("received", queue).inc()

    def started(self, queues: list[str]) -> None:
        for q in queues:
            self._task("started", q).inc()

    def retried(self, queue: str) -> None:
        self._task("retried", queue).inc()

    def batch(self, size: int) -> None:
        self.child(self.inference_count, self.model, self.modality).inc(size)
        self.child(self.exec_count, self.model, self.modality).inc()

    def finished(
        self,
        queue: str,
        code: str | None,
        run_s: float | None,
        queued_s: float | None,
        e2e_s: float | None,
    ) -> None:
        """One request's final outcome: ``code`` None for success, else its error code."""
        m, c = (self.model, self.modality), self.child
        if code is None:
            self._task("succeeded", queue).inc()
            c(self.success, *m).inc()
        else:
            self._task("revoked" if code == REVOKED else "failed", queue).inc()
            c(self.failure, *m, code).inc()
        if run_s is not None:
            c(self.runtime, self.task, self.hostname, queue).observe(run_s)
            c(self.compute_s, *m).observe(run_s)
        if queued_s is not None:
            c(self.queue_s, *m).observe(queued_s)
        if e2e_s is not None:
            c(self.request_s, *m).observe(e2e_s)

    def bind(self, active: Callable[[], float], pending: Callable[[], float]) -> None:
        """Gauges read at scrape time: requests running and requests held."""
        self._active = active
        self.tasks_active.labels(self.hostname).set_function(active)
        self.pending.labels(self.model, self.modality).set_function(pending)

    def set_hostname(self, hostname: str) -> None:
        """The worker's Celery node name, once known (``worker_init``, before any request)."""
        if not hostname or hostname == self.hostname:
            return
        self.worker_up.remove(self.hostname)
        if self._active is not None:
            self.tasks_active.remove(self.hostname)
            self.tasks_active.labels(hostname).set_function(self._active)
        self.hostname = hostname
        for counter in self._task_counters.values():
            counter.clear()
        self._children.clear()
        for queue in sorted(self.queues):
            for event in self._task_counters:
                self._task(event, queue)
        self.worker_up.labels(hostname).set(1)
