"""What an :class:`~workers.consumer.engine.Engine` shows of itself: the ``fleet_stats`` snapshot
and the point-in-time gauges read at scrape time.

Reads the engine's parts, changes nothing. Called by :meth:`Engine.snapshot` and at the
engine's construction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from workers.batching import heap, refusals
from workers.consumer import channel

if TYPE_CHECKING:
    from shared.metrics import FleetMetrics
    from workers.batching.batcher import Batcher, Lanes
    from workers.batching.completion import EngineStats
    from workers.batching.execution import CircuitBreaker
    from workers.consumer.lease import LeaseKeeper
    from workers.models.base import ModelAdapter
    from workers.models.runtime import DeviceRuntime


class Engine(Protocol):
    """What the stats read of an engine (``workers.consumer.engine.Engine``)."""

    modality: str
    ready: bool
    stats: EngineStats
    metrics: FleetMetrics
    batcher: Batcher
    breaker: CircuitBreaker
    keeper: LeaseKeeper | None
    runtime: DeviceRuntime
    lanes: Lanes
    adapter: ModelAdapter


__all__ = ["bind_gauges", "snapshot"]


def snapshot(engine: Engine) -> dict[str, Any]:
    """JSON-able stats of ``engine`` for the ``fleet_stats`` control command and metrics:
    counters since start, the held requests, leases, batch sizes and triggers, the breaker,
    the device runtime, the garbage collector's pauses and the model."""
    s = engine.stats
    return {
        "modality": engine.modality,
        "ready": engine.ready,
        "held": len(engine.batcher),
        "received": s.received,
        "succeeded": s.succeeded,
        "failed": s.failed,
        "expired": s.expired,
        "retried": s.retried,
        "acked_in_batches": s.acked_in_batches,
        "duplicates": s.duplicates,
        "twins": s.twins,
        "revoked": s.revoked,
        "settle_retries": s.settle_retries,
        "given_back": s.given_back,
        "leases": engine.keeper.snapshot() if engine.keeper else None,
        "broker_refusals": refusals.REFUSALS.snapshot(),
        "model_s": round(s.model_s, 6),
        "fetched_in_batches": channel.Channel.fetched_in_batches_total,
        "batches": s.batches,
        "batch_sizes": {str(k): v for k, v in sorted(s.batch_sizes.items())},
        "triggers": dict(s.triggers),
        "errors": dict(s.errors),
        "circuit": engine.breaker.snapshot(),
        "runtime": engine.runtime.stats(),
        "gc": heap.PAUSES.snapshot(),
        "main_lane_idle": None
        if engine.lanes.idle is None
        else {"idle_class": engine.lanes.idle.idle_class, "batches": engine.lanes.idle.batches},
        "model": engine.adapter.describe(),
    }


def bind_gauges(engine: Engine) -> None:
    """Point ``engine``'s gauges (held, circuit open, running, device memory in bytes, Redis
    refusing writes by reason) at functions read at scrape time."""
    m, metrics = engine.modality, engine.metrics
    metrics.held.labels(m).set_function(lambda: len(engine.batcher))
    metrics.circuit_open.labels(m).set_function(lambda: float(engine.breaker.state == "open"))
    metrics.eco.bind(lambda: len(engine.lanes.running), lambda: len(engine.batcher))
    metrics.device_memory.labels(m).set_function(
        lambda: (engine.runtime.stats().get("cuda_reserved_mb") or 0.0) * 2**20
    )
    held = refusals.REFUSALS
    for reason in refusals.REASONS:
        metrics.broker_refusing.labels(reason).set_function(
            lambda r=reason: float(r in held.reasons())
        )
