"""The table of series (``shared.metrics.series``) is what is exported: every series of it is
in a real registry under its name, with its type, help text and labels, and nothing else is;
the null objects (metrics off) have the same attributes as the real ones."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator

from celery import Celery
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from producer.ops.exporter import (
    all_queues,
    queue_families,
    shm_families,
    tenant_families,
    up_family,
)
from producer.ops.sent_events import SentTap
from shared.metrics import EcosystemMetrics, FleetMetrics
from shared.metrics.null import NULL_METRIC, NullEcosystemMetrics
from shared.metrics.series import SERIES, Series, of
from shared.queue_stats import QueueStats


def _families(registry: CollectorRegistry) -> dict[str, Metric]:
    return {mf.name: mf for mf in registry.collect()}


def _check(series: Iterable[Series], families: dict[str, Metric]) -> None:
    """Each series is a family of its name, type and help, whose samples carry exactly its
    labels, in its order (a histogram's ``le`` aside); and the registry holds no other."""
    series = list(series)
    assert set(families) == {s.name for s in series}
    for s in series:
        mf = families[s.name]
        assert (mf.type, mf.documentation) == (s.kind, s.help), s.name
        assert mf.samples, f"{s.name}: no sample to read its labels from"
        for sample in mf.samples:
            assert tuple(k for k in sample.labels if k != "le") == s.labels, sample


def _record(metric: object, s: Series) -> None:
    """One value in ``metric``, a child with made-up label values."""
    child = metric.labels(*(f"v{i}" for i in range(len(s.labels))))  # type: ignore[attr-defined]
    record = {"counter": "inc", "gauge": "set", "histogram": "observe"}[s.kind]
    getattr(child, record)(1)


def test_every_worker_series_is_in_a_workers_registry_with_its_type_and_labels() -> None:
    m = FleetMetrics("text", "minilm", "text@h", enabled=True)
    worker = [s for s in SERIES if s.owner in ("worker", "ecosystem")]
    for s in worker:
        _record(getattr(m if s.owner == "worker" else m.eco, s.attr), s)
    _check(worker, _families(m.registry))


def test_every_exporter_series_is_in_the_exporters_registry_with_its_type_and_labels() -> None:
    class Scrape:
        def collect(self) -> Iterator[Metric]:
            yield up_family(1.0)
            stats = [QueueStats("text", {0: 2, 9: 1}, reserved=3, oldest_submitted_ms=0.0)]
            yield from queue_families(stats, {"text": 2}, {0: "bulk", 9: "realtime"}, 5.0)
            yield from shm_families(10.0, 100.0)
            yield from tenant_families({("text", "acme"): QueueStats("text", {9: 4})}, {"acme": 7})

    registry = CollectorRegistry()
    registry.register(Scrape())
    tap = SentTap(Celery("fleet-test"), registry, all_queues())
    tap.on_sent({"name": "fleet.text", "hostname": "gen1@host", "queue": "text"})
    _check(of("exporter").values(), _families(registry))


def _public(obj: object) -> dict[str, object]:
    return {n: getattr(obj, n) for n in dir(obj) if not n.startswith("_")}


def test_the_null_objects_have_the_real_ones_attributes() -> None:
    """A hook or series added to the real objects and not to the null ones would fail only in
    a worker run with metrics off; this fails first."""
    on, off = (FleetMetrics("text", "m", "h", enabled=e) for e in (True, False))
    eco = EcosystemMetrics(CollectorRegistry(), "text", "m", "h")
    null_eco = NullEcosystemMetrics("text", "m", "h")
    for real, null in [(on, off), (eco, null_eco)]:
        real_api, null_api = _public(real), _public(null)
        assert set(real_api) == set(null_api), set(real_api) ^ set(null_api)
        for name, attr in real_api.items():
            if inspect.ismethod(attr):
                want = list(inspect.signature(attr).parameters)
                assert list(inspect.signature(null_api[name]).parameters) == want, name
    for owner, null in (("worker", off), ("ecosystem", null_eco)):
        assert all(getattr(null, attr) is NULL_METRIC for attr in of(owner)), owner
