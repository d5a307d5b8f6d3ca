"""The fleet's Prometheus metrics: the worker's metrics object, :class:`FleetMetrics`.

Modules: ``series`` (the table of every series the fleet exports: names, types, help texts, labels,
buckets; its docstring says how to add one), this one (the worker's real metrics, made from that
table: :class:`FleetMetrics` and, for the same events under Celery's and Triton's names,
:class:`EcosystemMetrics`), ``null`` (what a worker records with metrics off: nothing, behind the
same attributes).

Each worker serves them on ``127.0.0.1:<metrics.port_base + modality index>`` (text +0,
image +1, video +2, xmodal +3; ``port_base = 0`` turns the endpoint off, the metrics are still
recorded). ``[metrics] enabled = false`` turns them off entirely: :func:`configure` (the worker
calls it at import, before its engine exists) makes every later :class:`FleetMetrics` of the
process a null one (``shared.metrics.null``: same attributes and methods, nothing recorded)
and :func:`metrics_port` ``None``. Latencies are in seconds, as Prometheus expects. Flower
serves Celery's own task metrics at its ``/metrics``.

:class:`EcosystemMetrics`: worker series under the names Celery and Triton operators already
chart. Celery (as ``danihodovic/celery-exporter`` names them, so its Grafana dashboards read a
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

Label values are bounded: one task name and node per process, the models it serves (a
worker of several models labels each request, and each batch, with its own model's table;
``queue_models``), their queues (anything else is ``other``), error codes from
``shared.errors``.
Per request the cost is a few in-process counter and histogram updates: no I/O. The series
themselves (names, help texts, labels, buckets) are the ``ecosystem`` rows of
``shared.metrics.series.SERIES``, each an attribute of :class:`EcosystemMetrics`
(``task_received`` ... ``task_revoked``, ``runtime``, ``success``, ``queue_s`` ...).

Group updates: a worker settles requests in groups (a batch's results are stored, acked and
reported together), and every request updates about a dozen counters and histograms. Through
prometheus_client one at a time, each counter ``inc`` takes a lock and each histogram
``observe`` two (its sum and its bucket) after a linear bucket search: 7 % of a worker's CPU
with a model that costs nothing (py-spy on ``make bench WORKLOAD=overhead-saturate``).
:class:`Tally` collects a group's updates by series child and applies them with one ``inc``
per counter child, and per histogram child one ``inc`` per bucket touched plus one of the sum
(:func:`observe_many`). A scrape afterwards reads exactly what one update per request would
have left (``tests/unit/test_metrics_bulk.py``). The children a settled request updates
depend only on its ``(priority, outcome, queue)`` labels: :meth:`FleetMetrics.observe_requests`
finds them once per label set (:class:`RowChildren`, ``EcosystemMetrics.rows``).

prometheus_client names read (0.20-0.26; a histogram child has kept its bounds and bucket
values so since its first release): ``Histogram._upper_bounds``, ``._buckets``, ``._sum``. A
child without them (another client, a null metric) gets its plain ``observe`` per value.
"""

from __future__ import annotations

import socket
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, start_http_server

from shared import schema
from shared.errors import ERROR_CLASSES
from shared.metrics.null import NULL_METRIC, NullEcosystemMetrics
from shared.metrics.series import OTHER_QUEUE, REVOKED, TASK_EVENTS, make, of
from shared.schema import Priority
from shared.settings import MODALITIES, Settings

__all__ = [
    "EcosystemMetrics",
    "FleetMetrics",
    "RequestRow",
    "RowChildren",
    "Tally",
    "configure",
    "metrics_port",
    "observe_many",
    "serve",
]

RequestRow = tuple[str, str, float | None, float | None, str, float | None]


class RowChildren(NamedTuple):
    """The series children one settled request updates: each of ``counts`` by one, and each
    of ``queued``, ``e2e``, ``run`` with its queue, end-to-end and run seconds (when it has
    them)."""

    counts: tuple[Any, ...]
    queued: tuple[Any, ...]
    e2e: tuple[Any, ...]
    run: tuple[Any, ...]


_enabled = True  # this process's [metrics] enabled (configure)


def configure(settings: Settings) -> None:
    """Adopt ``[metrics] enabled`` for the :class:`FleetMetrics` this process makes later."""
    global _enabled
    _enabled = settings.metrics.enabled


class FleetMetrics:
    """The metrics of one worker process, in a registry of its own.

    Its series are attributes named as in ``shared.metrics.series.SERIES`` (owner
    ``worker``: ``requests``, ``batch_size``, ``held`` ...). ``eco`` holds the same events
    under Celery's and Triton's names (:class:`EcosystemMetrics`); ``model`` and
    ``hostname`` label those.

    ``enabled``: ``None`` follows :func:`configure` (default on). Off, every series and
    ``eco`` are null (``shared.metrics.null``), the hooks return at once and ``registry``
    stays empty.
    """

    def __init__(
        self,
        modality: str,
        model: str = "",
        hostname: str = "",
        enabled: bool | None = None,
        queue_models: dict[str, str] | None = None,
    ) -> None:
        self.modality = modality
        self.enabled = _enabled if enabled is None else enabled
        self.registry = CollectorRegistry()
        node = hostname or f"{modality}@{socket.gethostname()}"
        self.eco: EcosystemMetrics | NullEcosystemMetrics
        if not self.enabled:
            self.eco = NullEcosystemMetrics(modality, model or modality, node, queue_models)
            for attr in of("worker"):
                setattr(self, attr, NULL_METRIC)
            return
        self.eco = EcosystemMetrics(self.registry, modality, model or modality, node, queue_models)
        for attr, series in of("worker").items():
            setattr(self, attr, make(series, self.registry))
        self._zero_counters()

    def _zero_counters(self) -> None:
        """Every bounded label set at 0 from the start: ``rate()`` counts nothing of a
        series until its second sample, so a burst of 10 failures that created the series
        would never show as a failure rate."""
        codes = ["ok", *ERROR_CLASSES]
        for model in self._models():
            for prio in (*(p.label for p in Priority), "unknown"):
                for code in codes:
                    self.requests.labels(self.modality, model, prio, code)
        self.eco.zero(list(ERROR_CLASSES))

    def _models(self) -> list[str]:
        """The model tables this worker labels its series with: its default model's and
        each of its queues' (a worker of several models)."""
        return sorted({self.eco.model, *self.eco.queue_models.values()})

    def observe_batch(self, size: int, run_s: float, model: str | None = None) -> None:
        """A batch of ``size`` ran in ``run_s`` seconds (``model``: its model's table;
        ``None``: the worker's default)."""
        if not self.enabled:
            return
        self.eco.child(self.batch_size, self.modality, model or self.eco.model).observe(size)
        self.eco.child(self.inference, self.modality).observe(run_s)
        self.eco.batch(size, model)

    def observe_request(
        self,
        priority: str,
        outcome: str,
        queued_s: float | None,
        e2e_s: float | None,
        queue: str = OTHER_QUEUE,
        run_s: float | None = None,
    ) -> None:
        """One request's final outcome (``"ok"`` or an error code); seconds throughout."""
        self.observe_requests([(priority, outcome, queued_s, e2e_s, queue, run_s)])

    def observe_requests(self, rows: Sequence[RequestRow]) -> None:
        """Settled requests' outcomes, each ``(priority, outcome, queued_s, e2e_s, queue,
        run_s)`` as :meth:`observe_request` takes them; updated per series child at once
        (:class:`Tally`). The children a row updates depend only on its ``(priority,
        outcome, queue)``: found once per label set (:class:`RowChildren`, kept until the
        hostname changes), each child's values kept in row order."""
        if not self.enabled or not rows:
            return
        known = self.eco.rows
        counts: dict[tuple[str, str, str], int] = {}
        values: dict[Any, list[float]] = {}
        get = values.get
        for priority, outcome, queued_s, e2e_s, queue, run_s in rows:
            key = (priority, outcome, queue)
            ch = known.get(key)
            if ch is None:
                ch = known[key] = self._row_children(priority, outcome, queue)
            counts[key] = counts.get(key, 0) + 1
            for children, v in ((ch.queued, queued_s), (ch.e2e, e2e_s), (ch.run, run_s)):
                if v is not None:
                    for child in children:
                        got = get(child)
                        if got is None:
                            values[child] = [v]
                        else:
                            got.append(v)
        tally = Tally()
        for key, n in counts.items():
            for child in known[key].counts:
                tally.count(child, n)
        for child, vs in values.items():
            tally.extend(child, vs)
        tally.apply()

    def _row_children(self, priority: str, outcome: str, queue: str) -> RowChildren:
        """What a row of these labels updates: this object's series, then
        :meth:`EcosystemMetrics.finished_children`'s."""
        c, eco = self.eco.child, self.eco
        assert isinstance(eco, EcosystemMetrics)  # enabled
        model = eco.queue_models.get(queue, eco.model)  # its queue's model, as eco labels it
        theirs = eco.finished_children(queue, None if outcome == "ok" else outcome)
        return RowChildren(
            counts=(c(self.requests, self.modality, model, priority, outcome), *theirs.counts),
            queued=(c(self.queue_wait, self.modality, priority), *theirs.queued),
            e2e=(c(self.e2e, self.modality, priority), *theirs.e2e),
            run=theirs.run,
        )


def metrics_port(settings: Settings, modality: str) -> int | None:
    """The worker's metrics port, or ``None`` when metrics are off or not served."""
    base = settings.metrics.port_base
    return base + MODALITIES.index(modality) if base and settings.metrics.enabled else None


def serve(metrics: FleetMetrics, host: str, port: int) -> None:
    """Serve ``/metrics`` from a daemon thread (prometheus_client's own server)."""
    start_http_server(port, addr=host, registry=metrics.registry)


class EcosystemMetrics:
    """The Celery- and Triton-named series of one worker process.

    Args:
        registry: the worker's registry (``shared.metrics.FleetMetrics.registry``).
        modality: the worker's modality; model: its (default) model's name; hostname: its
            node name.
        queue_models: queue -> model table of every queue the worker consumes (a worker of
            several models: each request is labelled with its queue's model).
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        modality: str,
        model: str,
        hostname: str,
        queue_models: dict[str, str] | None = None,
    ) -> None:
        self.modality, self.model, self.hostname = modality, model, hostname
        self.task = schema.task_name(modality)
        self.queue_models = dict(queue_models or {})
        self.queues = {schema.queue_name(modality), schema.realtime_queue_name(modality)}
        self.queues |= set(self.queue_models)
        for attr, series in of("ecosystem").items():
            setattr(self, attr, make(series, registry))
        self._task_counters = {event: getattr(self, f"task_{event}") for event in TASK_EVENTS}
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        # FleetMetrics.observe_requests: (priority, outcome, queue) -> the children it updates
        self.rows: dict[tuple[str, str, str], RowChildren] = {}
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
        for queue in sorted(self.queues):
            for event in self._task_counters:
                self._task(event, queue)
        for model in sorted({self.model, *self.queue_models.values()}):
            m = (model, self.modality)
            self.success.labels(*m)
            for code in codes:
                self.failure.labels(*m, code)
            self.inference_count.labels(*m)
            self.exec_count.labels(*m)

    # -- hooks ---------------------------------------------------------------------------
    def received(self, queue: str) -> None:
        self._task("received", queue).inc()

    def started(self, queues: list[str]) -> None:
        """A batch started: one entry of ``queues`` per member (its queue label)."""
        for q in set(queues):
            self._task("started", q).inc(queues.count(q))

    def retried(self, queue: str) -> None:
        self._task("retried", queue).inc()

    def batch(self, size: int, model: str | None = None) -> None:
        model = model or self.model
        self.child(self.inference_count, model, self.modality).inc(size)
        self.child(self.exec_count, model, self.modality).inc()

    def finished(
        self,
        queue: str,
        code: str | None,
        run_s: float | None,
        queued_s: float | None,
        e2e_s: float | None,
        tally: Tally | None = None,
    ) -> None:
        """One request's final outcome: ``code`` None for success, else its error code.
        With ``tally`` the updates are recorded there (applied by its owner)."""
        t = Tally() if tally is None else tally
        ch = self.finished_children(queue, code)
        for child in ch.counts:
            t.count(child)
        for children, v in ((ch.run, run_s), (ch.queued, queued_s), (ch.e2e, e2e_s)):
            if v is not None:
                for child in children:
                    t.observe(child, v)
        if tally is None:
            t.apply()

    def finished_children(self, queue: str, code: str | None) -> RowChildren:
        """The series children a final outcome of ``queue`` updates (``code`` None for
        success, else its error code): the counters, and the histograms of its run, queue
        and end-to-end seconds."""
        m, c = (self.queue_models.get(queue, self.model), self.modality), self.child
        if code is None:
            counts = (self._task("succeeded", queue), c(self.success, *m))
        else:
            counts = (self._task("revoked" if code == REVOKED else "failed", queue),
                      c(self.failure, *m, code))  # fmt: skip
        return RowChildren(
            counts=counts,
            queued=(c(self.queue_s, *m),),
            e2e=(c(self.request_s, *m),),
            run=(c(self.runtime, self.task, self.hostname, queue), c(self.compute_s, *m)),
        )

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
        self.rows.clear()
        for queue in sorted(self.queues):
            for event in self._task_counters:
                self._task(event, queue)
        self.worker_up.labels(hostname).set(1)


def observe_many(child: Any, values: Iterable[float]) -> None:
    """``child.observe(v)`` for each of ``values`` (a histogram's labelled child), in one
    pass: each value's bucket by bisection (the first bound >= it, as ``observe`` finds
    it), one ``inc`` per bucket touched and one of the sum. A NaN adds to the sum and to no
    bucket, as ``observe`` does."""
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    if bounds is None or buckets is None or total is None:
        for v in values:
            child.observe(v)
        return
    counts: dict[int, int] = {}
    s = 0.0
    n = len(bounds)
    for v in values:
        s += v
        if v == v:  # not NaN
            i = bisect_left(bounds, v)
            if i < n:
                counts[i] = counts.get(i, 0) + 1
    total.inc(s)
    for i, k in counts.items():
        buckets[i].inc(k)


class Tally:
    """A group's counter increments and histogram observations, keyed by series child.

    ``count(child)`` / ``observe(child, v)`` record; :meth:`apply` makes the updates (one
    call per child) and empties the tally.
    """

    __slots__ = ("_counts", "_values")

    def __init__(self) -> None:
        self._counts: dict[Any, int] = {}
        self._values: dict[Any, list[float]] = {}

    def count(self, child: Any, n: int = 1) -> None:
        self._counts[child] = self._counts.get(child, 0) + n

    def observe(self, child: Any, value: float) -> None:
        got = self._values.get(child)
        if got is None:
            self._values[child] = [value]
        else:
            got.append(value)

    def extend(self, child: Any, values: list[float]) -> None:
        got = self._values.get(child)
        if got is None:
            self._values[child] = values
        else:
            got.extend(values)

    def apply(self) -> None:
        counts, values = self._counts, self._values
        self._counts, self._values = {}, {}
        for child, n in counts.items():
            child.inc(n)
        for child, vs in values.items():
            observe_many(child, vs)
