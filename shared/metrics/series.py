"""Every Prometheus series the fleet exports, in one table: :data:`SERIES`.

Each :class:`Series` says its name, type, help text, label names and (histograms) buckets,
and which object serves it:

- ``worker``: an attribute of ``shared.metrics.FleetMetrics``, in each worker's registry;
- ``ecosystem``: an attribute of ``shared.metrics.EcosystemMetrics`` (the same
  events under the names Celery's and Triton's dashboards read), in the same registry;
- ``exporter``: ``fleet exporter``'s (``producer.ops.exporter``): the queue-level gauges it
  builds at each scrape from one read of Redis, and ``celery_task_sent``
  (``producer.ops.sent_events``).

The real worker objects make their series from this table (:func:`make`), the
null ones (``[metrics] enabled = false``, ``shared.metrics.null``) put a no-op in each of
the same attributes, and the exporter takes its names and help texts from it; so a series
is written once. Counter names are without ``_total`` (prometheus_client appends it on
exposition: ``fleet_requests`` is scraped as ``fleet_requests_total``). Names, labels and
help texts are what dashboards and alert rules read (``configs/observability``,
``deploy/``): change one only together with them.

How to add a metric: add a :class:`Series` to :data:`SERIES` with the attribute that will
hold it, its owner, its name (``fleet_...``; a counter without ``_total``), type, help text,
label names (bounded values only: a modality, a priority class, an error code, never an id)
and, for a histogram, buckets (seconds: :data:`LATENCY_BUCKETS_S`). A ``worker`` or
``ecosystem`` series is then an attribute of the real and the null object alike: record
into it from a hook of that object (``FleetMetrics.observe_*``, which return at once when
``enabled`` is false; a new ``EcosystemMetrics`` hook needs its no-op twin in
``NullEcosystemMetrics``). An ``exporter`` gauge is built at scrape time with
``producer.ops.exporter.family`` and filled in ``QueueCollector.collect`` (and in the test's
scrape below).
``tests/unit/test_metrics_series.py`` checks that every series of the table is in a real
registry (a worker's, the exporter's) with its type, help text and labels, and that the null
objects have the same attributes as the real ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = [
    "BATCH_BUCKETS",
    "LATENCY_BUCKETS_S",
    "SERIES",
    "TASK_EVENTS",
    "Series",
    "make",
    "of",
]

Kind = Literal["counter", "gauge", "histogram"]
Owner = Literal["worker", "ecosystem", "exporter"]

OTHER_QUEUE = "other"  # the queue label of a message from any other queue
REVOKED = "REVOKED"


LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.35, 0.5, 1, 2, 5, 10, 30)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256)


@dataclass(frozen=True, slots=True)
class Series:
    """One series.

    Attributes:
        attr: the attribute of its owner's object that holds it (``exporter``: its key).
        owner: ``worker``, ``ecosystem`` or ``exporter`` (see the module docstring).
        name: the name it is exported under (a counter's without ``_total``).
        kind: ``counter``, ``gauge`` or ``histogram``.
        help: its help text.
        labels: its label names, in the order ``labels()`` takes their values.
        buckets: a histogram's bucket bounds.
    """

    attr: str
    owner: Owner
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


_TASK = ("name", "hostname", "queue_name")
_MM = ("model", "modality")
TASK_EVENTS = ("received", "started", "succeeded", "failed", "retried", "revoked")

SERIES: tuple[Series, ...] = (
    # EcosystemMetrics: Celery's names (as danihodovic/celery-exporter has them) ...
    *(
        Series(f"task_{e}", "ecosystem", f"celery_task_{e}", "counter", f"Tasks {e}", _TASK)
        for e in TASK_EVENTS
    ),
    Series("runtime", "ecosystem", "celery_task_runtime", "histogram",
           "Run time of a task (its batch), seconds", _TASK, LATENCY_BUCKETS_S),
    Series("worker_up", "ecosystem", "celery_worker_up", "gauge", "1 while the worker runs",
           ("hostname",)),
    Series("tasks_active", "ecosystem", "celery_worker_tasks_active", "gauge",
           "Requests in a running batch", ("hostname",)),
    # ... and the shape of Triton's nv_inference_*
    Series("success", "ecosystem", "fleet_inference_request_success", "counter",
           "Requests that succeeded", _MM),
    Series("failure", "ecosystem", "fleet_inference_request_failure", "counter",
           "Requests that failed, by reason (error code)", (*_MM, "reason")),
    Series("inference_count", "ecosystem", "fleet_inference_count", "counter",
           "Requests run by the model (batch members)", _MM),
    Series("exec_count", "ecosystem", "fleet_inference_exec_count", "counter",
           "Batches run by the model", _MM),
    Series("pending", "ecosystem", "fleet_inference_pending_request_count", "gauge",
           "Requests held, not yet running", _MM),
    Series("queue_s", "ecosystem", "fleet_inference_queue_duration_seconds", "histogram",
           "Window arrival to batch start, seconds", _MM, LATENCY_BUCKETS_S),
    Series("compute_s", "ecosystem", "fleet_inference_compute_duration_seconds", "histogram",
           "Run time of the request's batch, seconds", _MM, LATENCY_BUCKETS_S),
    Series("request_s", "ecosystem", "fleet_inference_request_duration_seconds", "histogram",
           "Submit to result stored (Redis' clock), seconds", _MM, LATENCY_BUCKETS_S),
    # FleetMetrics
    Series("requests", "worker", "fleet_requests", "counter",
           "Requests finished, by model and outcome (ok or an error code)",
           ("modality", "model", "priority", "outcome")),
    Series("batch_size", "worker", "fleet_batch_size", "histogram",
           "Requests per batch, by model", ("modality", "model"), BATCH_BUCKETS),
    Series("queue_wait", "worker", "fleet_queue_wait_seconds", "histogram",
           "Prefetch window arrival to batch start", ("modality", "priority"),
           LATENCY_BUCKETS_S),
    Series("inference", "worker", "fleet_inference_seconds", "histogram",
           "Run time of one batch (preprocess + forward)", ("modality",), LATENCY_BUCKETS_S),
    Series("e2e", "worker", "fleet_e2e_latency_seconds", "histogram",
           "Submit to result stored (Redis' clock)", ("modality", "priority"),
           LATENCY_BUCKETS_S),
    Series("held", "worker", "fleet_prefetch_held", "gauge",
           "Requests held in the prefetch window", ("modality",)),
    Series("device_memory", "worker", "fleet_device_memory_bytes", "gauge",
           "CUDA memory reserved by this worker (0 on CPU)", ("modality",)),
    Series("circuit_open", "worker", "fleet_circuit_open", "gauge",
           "1 while the model's circuit breaker is open", ("modality",)),
    Series("broker_refusing", "worker", "fleet_worker_broker_refusing", "gauge",
           "1 while Redis refuses this worker's writes (it does not fetch), by reason: "
           "MISCONF, OOM, READONLY, NOPERM", ("reason",)),
    Series("clock_skew", "worker", "fleet_worker_clock_skew_seconds", "gauge",
           "This worker's wall clock minus Redis' (TIME) at its last sample; deadlines, "
           "leases and liveness use Redis' clock (shared.clock)", ("modality",)),
    # fleet exporter: read from Redis at each scrape
    Series("redis_up", "exporter", "fleet_exporter_redis_up", "gauge",
           "1 when the last Redis read succeeded"),
    Series("queue_length", "exporter", "celery_queue_length", "gauge",
           "Messages waiting in Redis (all priority lists)", ("queue_name",)),
    Series("queue_waiting", "exporter", "fleet_queue_waiting", "gauge",
           "Messages waiting in Redis, by priority class", ("queue", "model", "priority")),
    Series("queue_reserved", "exporter", "fleet_queue_reserved", "gauge",
           "Messages delivered to workers and not acked", ("queue", "model")),
    Series("queue_demand", "exporter", "fleet_queue_demand", "gauge",
           "Waiting + reserved: submitted and not finished", ("queue", "model")),
    Series("queue_oldest_age", "exporter", "fleet_queue_oldest_age_seconds", "gauge",
           "Age of the oldest unfinished request", ("queue", "model")),
    Series("queue_consumers", "exporter", "fleet_queue_consumers", "gauge",
           "Live workers serving the queue's model", ("queue", "model")),
    Series("tenant_queued", "exporter", "fleet_tenant_queued", "gauge",
           "Messages waiting in a tenant's own lists (fair share; docs/tenants.md)",
           ("queue", "tenant")),
    Series("tenant_open", "exporter", "fleet_tenant_open", "gauge",
           "A tenant's requests queued or running, counted for its max_queued",
           ("tenant",)),
    Series("shm_used", "exporter", "fleet_shm_used_bytes", "gauge",
           "Bytes of the fleet's /dev/shm files"),
    Series("shm_capacity", "exporter", "fleet_shm_capacity_bytes", "gauge",
           "Budget of the fleet's /dev/shm files"),
    # fleet exporter: counted from producers' task-sent events
    Series("task_sent", "exporter", "celery_task_sent", "counter",
           "Tasks sent by producers (their task-sent events)", _TASK),
)  # fmt: skip


def of(owner: Owner) -> dict[str, Series]:
    """``owner``'s series by attribute, in the table's order."""
    return {s.attr: s for s in SERIES if s.owner == owner}


def make(series: Series, registry: CollectorRegistry) -> Any:
    """``series`` as a prometheus_client metric, registered in ``registry``."""
    labels = list(series.labels)
    if series.kind == "counter":
        return Counter(series.name, series.help, labels, registry=registry)
    if series.kind == "gauge":
        return Gauge(series.name, series.help, labels, registry=registry)
    return Histogram(series.name, series.help, labels, buckets=series.buckets, registry=registry)


def _check() -> None:
    """Attributes and names are unique; only histograms have buckets."""
    for key in ("attr", "name"):
        values = [getattr(s, key) for s in SERIES]
        dup = {v for v in values if values.count(v) > 1}
        if dup:
            raise ValueError(f"metric series: {key} used twice: {sorted(dup)}")
    for s in SERIES:
        if (s.buckets is not None) != (s.kind == "histogram"):
            raise ValueError(f"metric series {s.name}: buckets go with a histogram only")


_check()
