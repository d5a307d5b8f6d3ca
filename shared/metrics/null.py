"""What a worker records with ``[metrics] enabled = false``: nothing, behind the same interface.

:class:`NullMetric` stands for every ``Counter``, ``Gauge`` and ``Histogram`` of
``shared.metrics.FleetMetrics`` (and for their labelled children), and
:class:`NullEcosystemMetrics` for ``shared.metrics.EcosystemMetrics``: each hook
returns at once, no label is validated, no lock is taken, no registry holds a series. The
engine calls the same methods either way; only the object behind ``engine.metrics`` differs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shared import schema
from shared.metrics.series import OTHER_QUEUE, of

__all__ = ["NULL_METRIC", "NullEcosystemMetrics", "NullMetric"]


class NullMetric:
    """A metric, or a labelled child of one, that records nothing."""

    __slots__ = ()

    def labels(self, *_labels: str, **_kw: str) -> NullMetric:
        return self

    def inc(self, amount: float = 1.0) -> None:
        pass

    def dec(self, amount: float = 1.0) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def set_function(self, f: Callable[[], float]) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass

    def remove(self, *_labels: str) -> None:
        pass

    def clear(self) -> None:
        pass


NULL_METRIC = NullMetric()


class NullEcosystemMetrics:
    """``EcosystemMetrics``' interface, recording nothing (metrics off)."""

    def __init__(
        self, modality: str, model: str, hostname: str, queue_models: dict[str, str] | None = None
    ) -> None:
        self.modality, self.model, self.hostname = modality, model, hostname
        self.task = schema.task_name(modality)
        self.queues = {schema.queue_name(modality), schema.realtime_queue_name(modality)}
        self.queue_models = dict(queue_models or {})
        self.rows: dict[tuple[str, str, str], Any] = {}
        for attr in of("ecosystem"):  # the series of shared.metrics.series, recording nothing
            setattr(self, attr, NULL_METRIC)

    def queue_label(self, routing_key: str | None) -> str:
        return OTHER_QUEUE

    def queue_of(self, req: object) -> str:
        return OTHER_QUEUE

    def child(self, metric: Any, *labels: str) -> NullMetric:
        return NULL_METRIC

    def zero(self, codes: list[str]) -> None:
        pass

    def received(self, queue: str) -> None:
        pass

    def started(self, queues: list[str]) -> None:
        pass

    def retried(self, queue: str) -> None:
        pass

    def batch(self, size: int, model: str | None = None) -> None:
        pass

    def finished(
        self,
        queue: str,
        code: str | None,
        run_s: float | None,
        queued_s: float | None,
        e2e_s: float | None,
        tally: Any = None,
    ) -> None:
        pass

    def finished_children(self, queue: str, code: str | None) -> Any:
        return None

    def bind(self, active: Callable[[], float], pending: Callable[[], float]) -> None:
        pass

    def set_hostname(self, hostname: str) -> None:
        if hostname:
            self.hostname = hostname
