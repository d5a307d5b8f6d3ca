"""The Celery app that fleet workers run: ``celery -A workers.consumer.app worker -Q text ...``.

``fleet worker text`` is the supported way to start one (it sets the environment below and
the right Celery options); the raw ``celery`` command works with the same environment.

Environment:
    FLEET_WORKER_MODALITY  the modality this process serves (required): text, image, ...
    FLEET_WORKER_MODE      ``batch`` (default): the batching engine takes messages from the
                           prefetch window; ``baseline``: plain Celery, one task per message,
                           executed by the task body (the benchmark's baseline).
    FLEET_WORKER_MODELS    the ``[models.<name>]`` tables this process serves, comma-separated
                           (default: every model the modality serves; ``shared.model_routes``).
                           ``-Q`` must name their queues (``fleet worker`` does).

The model is loaded and warmed in ``worker_init``, before the consumer starts, so a worker
that answers a ping has its model ready. With the solo pool that process is the worker
process itself: CUDA (if any) is initialised there and in no parent.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

from celery import signals
from celery.worker.control import inspect_command

from shared import metrics, model_routes
from shared.celery_app import make_app
from shared.errors import FleetError
from shared.metrics import metrics_port, serve
from shared.schema import task_name
from shared.settings import MODALITIES, load_settings
from workers.batching import heap
from workers.consumer import clock_watch
from workers.consumer.channel import install_receiver
from workers.consumer.lease import lease_transport_options
from workers.consumer.realtime import realtime_consumer_step
from workers.consumer.tenant_turns import tenant_transport_options
from workers.janitor import ShmJanitor
from workers.models.runtime import refuse_early_cuda, validate_partitions
from workers.probe import PROBE_TASK, read_tensor

if TYPE_CHECKING:
    from workers.consumer.engine import Engine

log = logging.getLogger("fleet.worker")

settings = load_settings()
metrics.configure(settings)  # [metrics] enabled = false: the engine's metrics are null ones
app = make_app(settings, name="fleet-worker", role="worker")


def _register(modality: str) -> None:
    @app.task(name=task_name(modality), bind=True, throws=(FleetError,), acks_late=True)
    def infer(self: Any, request: dict[str, Any]) -> dict[str, Any]:
        """One request run on its own (baseline mode). Raises FleetError with its code."""
        return current_engine().run_one(request)


for _m in MODALITIES:
    _register(_m)


@app.task(name=PROBE_TASK, throws=(FleetError,), acks_late=True)
def transport_probe(tensor: dict[str, Any]) -> dict[str, Any]:
    """Read one tensor sent through the transport (see ``workers.probe``)."""
    return read_tensor(settings, tensor)


def current_engine() -> Engine:
    """This process's engine (``workers.consumer.engine.current``, imported when first asked:
    importing the engine imports torch, which ``celery -A workers.consumer.app`` commands
    other than ``worker`` never need)."""
    from workers.consumer.engine import current

    return current()


@signals.worker_init.connect
def _start_engine(sender: Any = None, **_: Any) -> None:
    from workers.consumer.engine import Engine, install

    modality = os.environ.get("FLEET_WORKER_MODALITY", "")
    if modality not in MODALITIES:
        raise SystemExit(f"FLEET_WORKER_MODALITY must be one of {MODALITIES}, not {modality!r}")
    mode = os.environ.get("FLEET_WORKER_MODE", "batch")
    refuse_early_cuda()
    validate_partitions(settings)
    heap.PAUSES.install()  # collection pauses, for fleet_stats (workers.batching.heap)
    try:
        served = model_routes.worker_models(
            settings, modality, os.environ.get("FLEET_WORKER_MODELS", "")
        )
        models = [m.table for m in served]
        engine = Engine(modality, settings, app, threaded=(mode == "batch"), models=models)
        engine.start()
    except Exception as exc:
        # Celery logs and swallows exceptions of signal handlers; a worker without its
        # engine would still answer pings. SystemExit is not swallowed: refuse to start.
        log.exception("engine failed to start")
        raise SystemExit(f"fleet worker {modality}: engine failed to start: {exc}") from exc
    engine.metrics.eco.set_hostname(getattr(sender, "hostname", "") or "")
    install(engine)
    if mode == "batch":
        app.tasks[task_name(modality)].Strategy = "workers.consumer.engine:batching_strategy"
        # The baseline stays plain Celery: kombu's own transport, one BRPOP per message.
        if settings.ha:
            from shared.ha import WORKER_TRANSPORT, pin_sentinel_transport

            app.conf.broker_transport = WORKER_TRANSPORT
            pin_sentinel_transport(WORKER_TRANSPORT)  # kept through kombu's failover switch
        else:
            app.conf.broker_transport = "workers.consumer.channel:Transport"
        install_receiver(engine.front_door.receive)  # engine.FrontDoor
        app.conf.broker_transport_options = {
            **app.conf.broker_transport_options,
            "fetch_limit": engine.cfg.device.fetch_limit,
            "fetch_notify": settings.redis.fetch_notify,
            **lease_transport_options(settings),
            **tenant_transport_options(settings),
        }
        engine.start_leases()
        # Redis' clock for every timestamp (workers.consumer.clock_watch)
        if engine.keeper is not None:
            gauge = engine.metrics.clock_skew.labels(modality)
            clock_watch.start(engine.keeper.clock, settings.redis.clock_skew_warn_s, gauge)
        if engine.cfg.batching.realtime_lane:
            queues = model_routes.worker_queues(served, realtime_apart=True)[1]
            step = realtime_consumer_step(modality, engine.cfg.batching.realtime_prefetch, queues)
            app.steps["consumer"].add(step)
    log.info("worker mode=%s modality=%s models=%s", mode, modality, ",".join(models))


@signals.worker_ready.connect
def _log_ready(sender: Any = None, **_: Any) -> None:
    # Celery's logging is configured by now (it is not yet in worker_init).
    engine = current_engine()
    if engine.keeper is not None and sender is not None:
        try:
            serves_default = engine.cfg.model in engine.models  # it consumes <modality>
            engine.keeper.announce(
                engine.modality, sender.hostname, engine.models, default=serves_default
            )
        except Exception as exc:  # Redis away: the next renewal announces it
            log.warning("liveness not announced yet: %s", exc)
    clock_watch.remind()  # the first sample's warning came before logging was configured
    # Everything alive now lives as long as the process: out of the collector's full
    # passes, which otherwise hold the event loop (see workers.batching.heap).
    frozen = heap.freeze_startup_heap()
    heap.PAUSES.reset()  # the worker's stats count serving pauses, not startup's
    warning = _shm_warning()
    if warning:
        log.warning("%s", warning)
    _start_janitor()
    port = metrics_port(settings, engine.modality)
    if port:
        try:
            serve(engine.metrics, settings.metrics.host, port)
        except OSError as exc:  # e.g. another stack on this host holds the port
            log.warning("metrics endpoint not started on port %d: %s", port, exc)
            port = None
    log.info(
        "fleet worker ready modality=%s model=%s runtime=%s warmup_later=%s gc_frozen=%d "
        "metrics=%s",
        engine.modality,
        engine.adapter.describe(),
        engine.runtime.stats(),
        engine.warmup_later,
        frozen,
        f"http://{settings.metrics.host}:{port}/metrics" if port else "off",
    )


def _shm_warning() -> str | None:
    """A warning when /dev/shm is smaller than the transport's budget (Docker: 64 MB)."""
    try:
        from shared.transport import process_store

        return process_store(settings, role="worker").check_capacity(
            settings.transport.min_shm_warn_bytes
        )
    except FleetError as exc:
        return f"shared-memory transport unavailable: {exc}"


_janitor: ShmJanitor | None = None


def _start_janitor() -> None:
    global _janitor
    t = settings.transport
    if t.shared_host and t.janitor_interval_s > 0 and _janitor is None:
        _janitor = ShmJanitor(settings, t.janitor_interval_s)
        _janitor.start()


@signals.worker_shutdown.connect
def _stop_engine(**_: Any) -> None:
    if _janitor is not None:
        _janitor.stop()
    with contextlib.suppress(RuntimeError):
        current_engine().stop()
    from shared import tracing

    tracing.shutdown()  # flush the last spans (a no-op without tracing)


@inspect_command()
def fleet_stats(state: Any) -> dict[str, Any]:
    """``celery inspect fleet_stats``: the engine's counters, batch sizes and device facts,
    and whether it records metrics (``[metrics] enabled``) and traces."""
    try:
        engine = current_engine()
        snap = engine.snapshot()
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {**snap, "metrics_enabled": engine.metrics.enabled, "tracing": engine.tracing.on}
