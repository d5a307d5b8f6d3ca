"""``fleet exporter``: the queue-level Prometheus series, read from Redis at each scrape.

Workers serve their own series (``shared.metrics``); what no single worker can see is
served here, by one process per fleet (``fleet up`` starts it on ``[metrics] exporter_host``
and ``exporter_port``, 127.0.0.1:9100 by default; port 0 = off):

========================================== ==================================================
series                                      meaning
========================================== ==================================================
``celery_queue_length{queue_name}``         messages waiting in Redis, all ten priority lists
                                            (celery-exporter's name; it counts one list)
``fleet_queue_waiting{queue,model,``        waiting, by priority class (Celery steps that no
``priority}``                               class uses are summed under ``other``)
``fleet_queue_reserved{queue,model}``       delivered to workers and not acked: prefetch
                                            windows, batchers, running, a dead worker's
                                            until its leases lapse
``fleet_queue_demand{queue,model}``         waiting + reserved: what an autoscaler reads
``fleet_queue_oldest_age_seconds{queue,``   age of the oldest unfinished request (0: none)
``model}``
``fleet_queue_consumers{queue,model}``      live workers serving the queue's model
``fleet_shm_used_bytes``                    bytes of the fleet's /dev/shm files
``fleet_shm_capacity_bytes``                their budget (``[transport] capacity_*``)
``fleet_exporter_redis_up``                 1 when the last read of Redis succeeded
``celery_task_sent_total{name,hostname,``   producers' ``task-sent`` events
``queue_name}``                             (``producer.ops.sent_events``)
========================================== ==================================================

Queues: each modality's pair (its default model's) and the pair of each other model it serves
(``shared.model_routes``); ``model`` is the queue's ``[models.<name>]`` table, so a
Deployment per model scales on its own ``fleet_queue_demand{model="..."}``.

Every value is read at scrape time (one Lua script for all queues, ``shared.queue_stats``);
nothing is cached between scrapes. The exporter connects as the ``operator`` Redis user.
Names, help texts and labels are the ``exporter`` rows of ``shared.metrics.series.SERIES``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shared import model_routes, schema, tenant_quota
from shared.clock import RedisClock
from shared.metrics.series import of
from shared.queue_stats import QueueReader, QueueStats
from shared.settings import MODALITIES, Settings

log = logging.getLogger("fleet.exporter")

_SERIES = of("exporter")
_QUEUE_FAMILIES = ("queue_length", "queue_waiting", "queue_reserved", "queue_demand",
                   "queue_oldest_age", "queue_consumers")  # fmt: skip


def all_queues(settings: Settings | None = None) -> list[str]:
    """Every queue of the fleet: each modality's and its REALTIME queue, then (with
    ``settings``) the pair of each model other than a modality's default."""
    out = [q for m in MODALITIES for q in (schema.queue_name(m), schema.realtime_queue_name(m))]
    return out + [q for q in queue_models(settings) if q not in out] if settings else out


def queue_models(settings: Settings | None) -> dict[str, tuple[str, str]]:
    """Queue -> (modality, model table) of every model the fleet serves
    (``shared.model_routes``)."""
    out: dict[str, tuple[str, str]] = {}
    for modality in MODALITIES if settings is not None else ():
        for m in model_routes.catalog(settings, modality):  # type: ignore[arg-type]
            out[m.queue] = out[m.realtime_queue] = (modality, m.table)
    return out


def step_labels(settings: Settings) -> dict[int, str]:
    """Celery priority step -> the priority class label that uses it (``other`` if none)."""
    by_step = {p.celery_priority: label for label, p in sorted(settings.priorities.items())}
    return {s: by_step.get(s, "other") for s in schema.PRIORITY_STEPS}


def family(attr: str) -> GaugeMetricFamily:
    """An empty family of the exporter's gauge ``attr`` (``shared.metrics.series``), to
    fill at scrape time.

    Raises:
        KeyError: no exporter series ``attr``.
        ValueError: it is not a gauge.
    """
    s = _SERIES[attr]
    if s.kind != "gauge":
        raise ValueError(f"{s.name} is a {s.kind}, not a gauge built at scrape time")
    return GaugeMetricFamily(s.name, s.help, labels=list(s.labels))


def up_family(ok: float) -> GaugeMetricFamily:
    """``fleet_exporter_redis_up``: ``ok`` is 1.0 when the last read of Redis succeeded."""
    up = family("redis_up")
    up.add_metric([], ok)
    return up


def queue_families(
    stats: list[QueueStats],
    consumers: dict[str, int],
    steps: dict[int, str],
    now: float,
    models: dict[str, tuple[str, str]] | None = None,
) -> Iterator[GaugeMetricFamily]:
    """The queue families of one read: ``consumers`` per queue (its live workers; a
    modality's name: those of its default queues), ``steps`` as :func:`step_labels`, ``now``
    Redis' time (seconds), ``models`` as :func:`queue_models` (a queue missing there: its
    ``model`` label is empty)."""
    length, waiting, reserved, demand, age, live = (family(a) for a in _QUEUE_FAMILIES)
    models = models or {}
    for st in stats:
        q = st.queue
        model = models.get(q, ("", ""))[1]
        length.add_metric([q], st.waiting_total)
        by_class: dict[str, int] = {}
        for step, n in st.waiting.items():
            label = steps[step]
            by_class[label] = by_class.get(label, 0) + n
        for label, n in sorted(by_class.items()):
            waiting.add_metric([q, model, label], n)
        reserved.add_metric([q, model], st.reserved)
        demand.add_metric([q, model], st.demand)
        age.add_metric([q, model], st.oldest_age_s(now))
        base = q.removesuffix(".realtime")
        live.add_metric([q, model], consumers.get(q, consumers.get(base, 0)))
    yield from (length, waiting, reserved, demand, age, live)


def tenant_families(
    by_tenant: dict[tuple[str, str], QueueStats], open_: dict[str, int]
) -> Iterator[GaugeMetricFamily]:
    """``fleet_tenant_queued`` per (queue, tenant) list set and ``fleet_tenant_open`` per
    limited tenant (none configured: empty families)."""
    queued, opened = family("tenant_queued"), family("tenant_open")
    for (queue, tenant), st in sorted(by_tenant.items()):
        queued.add_metric([queue, tenant], st.waiting_total)
    for tenant, n in sorted(open_.items()):
        opened.add_metric([tenant], n)
    yield from (queued, opened)


def shm_families(used: float, capacity: float) -> Iterator[GaugeMetricFamily]:
    """The fleet's /dev/shm bytes in use and its budget."""
    g = family("shm_used")
    g.add_metric([], used)
    yield g
    c = family("shm_capacity")
    c.add_metric([], capacity)
    yield c


class QueueCollector(Collector):
    """Yields the queue-level families from one Redis read per scrape.

    Args:
        settings: the fleet's settings (Redis address, priority classes, lease, shm).
        client: a ``redis.Redis`` as the ``operator`` user; built from settings if omitted.
    """

    def __init__(self, settings: Settings, client: Any = None) -> None:
        from shared.redis_client import redis_client

        self.settings = settings
        self.client = client or redis_client(settings, "operator", socket_timeout=5.0)
        # Redis' clock (shared.clock): submit times and heartbeats are on it, not on this host's
        self.clock = RedisClock(self.client.time)
        self.queues = all_queues(settings)
        self.models = queue_models(settings)
        default = settings.tenancy.default_tenant
        own = sorted(n for n in settings.tenants if n != default)  # lists of their own
        self.reader = QueueReader(self.client, self.queues, own)
        self.limited = sorted(tenant_quota.limits(settings))
        self.steps = step_labels(settings)
        self._lock = threading.Lock()  # concurrent scrapes read Redis one at a time
        self._shm: Any = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            try:
                stats, _other = self.reader.read()
                consumers = self._consumers()
                open_ = self._open()
                ok = 1.0
            except Exception as exc:  # a scrape must answer even when Redis does not
                log.warning("reading queue stats failed: %s", exc)
                stats, consumers, open_, ok = [], {}, {}, 0.0
        yield up_family(ok)
        yield from queue_families(stats, consumers, self.steps, self.clock.now(), self.models)
        yield from tenant_families(self.reader.by_tenant if ok else {}, open_)
        yield from self._shm_families()

    def _open(self) -> dict[str, int]:
        """Each limited tenant's requests queued or running (``shared.tenant_quota``)."""
        if not self.limited:
            return {}
        with self.client.pipeline(transaction=False) as pipe:
            for t in self.limited:
                pipe.scard(tenant_quota.open_key(t))
            counts = pipe.execute()
        return {t: int(n) for t, n in zip(self.limited, counts, strict=True)}

    def _consumers(self) -> dict[str, int]:
        """Live workers per queue: those serving its model, heartbeats younger than a lease
        (``workers.consumer.lease``)."""
        since = self.clock.now() - self.settings.redis.lease_s
        queues = [q for q in self.queues if q in self.models]
        with self.client.pipeline(transaction=False) as pipe:
            for q in queues:
                modality, table = self.models[q]
                default = q.removesuffix(".realtime") == schema.queue_name(modality)
                # the default queue's consumers are in the modality's set
                pipe.zcount(schema.live_key(modality, None if default else table), since, "+inf")
            counts = pipe.execute()
        return {q: int(n) for q, n in zip(queues, counts, strict=True)}

    def _shm_families(self) -> Iterator[GaugeMetricFamily]:
        store = self._store()
        if store is None:
            return
        try:
            used, cap = store.used_bytes(), store.capacity_bytes
        except Exception as exc:
            log.warning("reading /dev/shm usage failed: %s", exc)
            return
        yield from shm_families(used, cap)

    def _store(self) -> Any:
        if self._shm is None and self.settings.transport.shared_host:
            from shared.transport import ShmStore

            t = self.settings.transport
            try:
                self._shm = ShmStore(
                    t.shm_root,
                    t.capacity_bytes,
                    capacity_fraction=t.capacity_fraction,
                    role="worker",
                )
            except Exception as exc:
                log.warning("no /dev/shm store to report on: %s", exc)
                self._shm = False
        return self._shm or None


def build_registry(settings: Settings, client: Any = None) -> CollectorRegistry:
    """A registry holding only the queue collector (no process metrics of the exporter)."""
    registry = CollectorRegistry()
    registry.register(QueueCollector(settings, client))
    return registry


def start_sent_tap(settings: Settings, registry: CollectorRegistry) -> Any:
    """Count producers' ``task-sent`` events into ``registry`` (``producer.ops.sent_events``)
    from a daemon thread; returns the thread."""
    from producer.ops.sent_events import SentTap
    from shared.celery_app import make_app

    tap = SentTap(make_app(settings, name="fleet-exporter", role="operator"), registry,
                  all_queues(settings))  # fmt: skip
    tap.start()
    return tap


def exporter_ok(settings: Settings) -> bool:
    """Whether the exporter of ``settings`` answers ``/metrics`` with 200."""
    import urllib.request

    m = settings.metrics
    try:
        url = f"http://{m.exporter_host}:{m.exporter_port}/metrics"
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            return resp.status == 200
    except Exception:
        return False


def serve_forever(settings: Settings) -> None:
    """Serve ``/metrics`` on ``[metrics] exporter_host:exporter_port`` until killed.

    Raises:
        OSError: the port is taken.
        ValueError: the exporter is off (port 0).
    """
    m = settings.metrics
    if not m.exporter_port:
        raise ValueError("the exporter is off ([metrics] exporter_port = 0)")
    registry = build_registry(settings)
    start_sent_tap(settings, registry)
    start_http_server(m.exporter_port, addr=m.exporter_host, registry=registry)
    log.info("fleet exporter on http://%s:%d/metrics", m.exporter_host, m.exporter_port)
    stop = threading.Event()
    stop.wait()
