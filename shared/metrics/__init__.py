"""The fleet's Prometheus metrics: the worker's metrics object, :class:`FleetMetrics`.

Modules: ``series`` (the table of every series the fleet exports: names, types, help texts,
labels, buckets; its docstring says how to add one), this one (the worker's real metrics,
made from that table), ``ecosystem`` (the same events under Celery's and Triton's names),
``null`` (what a worker records with metrics off: nothing, behind the same attributes).

Each worker serves them on ``127.0.0.1:<metrics.port_base + modality index>`` (text +0,
image +1, video +2, xmodal +3; ``port_base = 0`` turns the endpoint off, the metrics are still
recorded). ``[metrics] enabled = false`` turns them off entirely: :func:`configure` (the worker
calls it at import, before its engine exists) makes every later :class:`FleetMetrics` of the
process a null one (``shared.metrics.null``: same attributes and methods, nothing recorded)
and :func:`metrics_port` ``None``. Latencies are in seconds, as Prometheus expects. Flower
serves Celery's own task metrics at its ``/metrics``.
"""

from __future__ import annotations

import socket

from prometheus_client import CollectorRegistry, start_http_server

from shared.errors import ERROR_CLASSES
from shared.metrics.ecosystem import OTHER_QUEUE, EcosystemMetrics
from shared.metrics.null import NULL_METRIC, NullEcosystemMetrics
from shared.metrics.series import make, of
from shared.schema import Priority
from shared.settings import MODALITIES, Settings

__all__ = ["FleetMetrics", "configure", "metrics_port", "serve"]

_enabled = True  # this process's [metrics] enabled (configure)


def configure(settings: Settings) -> None:
    """Adopt ``[metrics] enabled`` for the :class:`FleetMetrics` this process makes later."""
    global _enabled
    _enabled = settings.metrics.enabled


class FleetMetrics:
    """The metrics of one worker process, in a registry of its own.

    Its series are attributes named as in ``shared.metrics.series.SERIES`` (owner
    ``worker``: ``requests``, ``batch_size``, ``held`` ...). ``eco`` holds the same events
    under Celery's and Triton's names (``shared.metrics.ecosystem``); ``model`` and
    ``hostname`` label those.

    ``enabled``: ``None`` follows :func:`configure` (default on). Off, every series and
    ``eco`` are null (``shared.metrics.null``), the hooks return at once and ``registry``
    stays empty.
    """

    def __init__(
        self, modality: str, model: str = "", hostname: str = "", enabled: bool | None = None
    ) -> None:
        self.modality = modality
        self.enabled = _enabled if enabled is None else enabled
        self.registry = CollectorRegistry()
        node = hostname or f"{modality}@{socket.gethostname()}"
        self.eco: EcosystemMetrics | NullEcosystemMetrics
        if not self.enabled:
            self.eco = NullEcosystemMetrics(modality, model or modality, node)
            for attr in of("worker"):
                setattr(self, attr, NULL_METRIC)
            return
        self.eco = EcosystemMetrics(self.registry, modality, model or modality, node)
        for attr, series in of("worker").items():
            setattr(self, attr, make(series, self.registry))
        self._zero_counters()

    def _zero_counters(self) -> None:
        """Every bounded label set at 0 from the start: ``rate()`` counts nothing of a
        series until its second sample, so a burst of 10 failures that created the series
        would never show as a failure rate."""
        codes = ["ok", *ERROR_CLASSES]
        for prio in (*(p.label for p in Priority), "unknown"):
            for code in codes:
                self.requests.labels(self.modality, prio, code)
        self.eco.zero(list(ERROR_CLASSES))

    def observe_batch(self, size: int, run_s: float) -> None:
        if not self.enabled:
            return
        self.eco.child(self.batch_size, self.modality).observe(size)
        self.eco.child(self.inference, self.modality).observe(run_s)
        self.eco.batch(size)

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
        if not self.enabled:
            return
        c = self.eco.child
        c(self.requests, self.modality, priority, outcome).inc()
        if queued_s is not None:
            c(self.queue_wait, self.modality, priority).observe(queued_s)
        if e2e_s is not None:
            c(self.e2e, self.modality, priority).observe(e2e_s)
        self.eco.finished(queue, None if outcome == "ok" else outcome, run_s, queued_s, e2e_s)


def metrics_port(settings: Settings, modality: str) -> int | None:
    """The worker's metrics port, or ``None`` when metrics are off or not served."""
    base = settings.metrics.port_base
    return base + MODALITIES.index(modality) if base and settings.metrics.enabled else None


def serve(metrics: FleetMetrics, host: str, port: int) -> None:
    """Serve ``/metrics`` from a daemon thread (prometheus_client's own server)."""
    start_http_server(port, addr=host, registry=metrics.registry)
