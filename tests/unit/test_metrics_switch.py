"""``[metrics] enabled``: on, a worker's hooks record into its prometheus_client registry; off,
the same calls record nothing and no /metrics port is given out."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from producer.stack.local import Stack
from shared import metrics
from shared.metrics import FleetMetrics, metrics_port
from shared.metrics.null import NullEcosystemMetrics
from shared.settings import MetricsSettings, Settings, load_settings


def _settings(**metrics_kw: object) -> Settings:
    return Settings(metrics=MetricsSettings(**metrics_kw))


@pytest.fixture(autouse=True)
def _default_switch() -> Iterator[None]:
    yield
    metrics.configure(Settings())  # the process default again (on)


def _exercise(m: FleetMetrics) -> None:
    """Every hook the engine and the worker app call, once."""
    eco = m.eco
    queue = eco.queue_label("text")
    eco.set_hostname("text@node")
    m.held.labels("text").set_function(lambda: 7.0)
    m.circuit_open.labels("text").set_function(lambda: 0.0)
    m.device_memory.labels("text").set_function(lambda: 0.0)
    eco.bind(lambda: 2.0, lambda: 7.0)
    eco.received(queue)
    eco.started([queue, queue])
    eco.retried(queue)
    m.observe_batch(2, 0.04)
    m.observe_request("bulk", "ok", 0.01, 0.2, queue, run_s=0.04)
    m.observe_request("bulk", "DEADLINE_EXCEEDED", None, 2.5, queue)


def _value(text: str, series: str) -> float:
    """The value of one exposition line that starts with ``series``."""
    lines = [ln for ln in text.splitlines() if ln.startswith(series)]
    assert len(lines) == 1, (series, lines)
    return float(lines[0].rsplit(" ", 1)[1])


def test_on_the_hooks_record_into_the_registry() -> None:
    m = FleetMetrics("text", "minilm", "text@boot", enabled=True)
    _exercise(m)
    text = generate_latest(m.registry).decode()
    ok = 'fleet_requests_total{modality="text",model="minilm",outcome="ok",priority="bulk"}'
    assert _value(text, ok) == 1.0
    missed = (
        'fleet_requests_total{modality="text",model="minilm",outcome="DEADLINE_EXCEEDED",'
        'priority="bulk"}'
    )
    assert _value(text, missed) == 1.0
    assert _value(text, 'fleet_batch_size_count{modality="text",model="minilm"}') == 1.0
    assert _value(text, 'fleet_inference_exec_count_total{modality="text",model="minilm"}') == 1.0
    assert _value(text, 'fleet_inference_count_total{modality="text",model="minilm"}') == 2.0
    started = 'celery_task_started_total{hostname="text@node",name="fleet.text",queue_name="text"}'
    assert _value(text, started) == 2.0
    assert _value(text, 'fleet_prefetch_held{modality="text"}') == 7.0
    assert _value(text, 'celery_worker_tasks_active{hostname="text@node"}') == 2.0


def test_off_the_same_calls_record_nothing() -> None:
    m = FleetMetrics("text", "minilm", "text@boot", enabled=False)
    _exercise(m)
    assert not m.enabled
    assert isinstance(m.eco, NullEcosystemMetrics)
    assert generate_latest(m.registry) == b""  # not a series, not even one at zero
    assert m.eco.hostname == "text@node"


def test_configure_decides_for_the_metrics_made_afterwards() -> None:
    metrics.configure(_settings(enabled=False))
    off = FleetMetrics("image", "resnet18")
    assert not off.enabled and generate_latest(off.registry) == b""
    metrics.configure(_settings(enabled=True))
    on = FleetMetrics("image", "resnet18")
    assert on.enabled and b"fleet_requests_total" in generate_latest(on.registry)


def test_no_metrics_port_when_off_whatever_port_base_says() -> None:
    assert metrics_port(_settings(port_base=9101), "image") == 9102
    assert metrics_port(_settings(port_base=0), "image") is None
    assert metrics_port(_settings(port_base=9101, enabled=False), "image") is None


def test_fleet_up_checks_no_metrics_port_of_a_worker_with_metrics_off(tmp_path: Path) -> None:
    def metric_ports(**metrics_kw: object) -> list[int]:
        s = load_settings(stack={"run_dir": str(tmp_path)}, metrics=metrics_kw)
        planned = Stack(s).planned_ports([("text", 0), ("image", 1)], flower=False)
        return [port for name, _h, port, *_ in planned if name.startswith("worker-")]

    assert metric_ports(port_base=9101) == [9101, 9106]  # image's replica 1: +4 +1
    assert metric_ports(port_base=9101, enabled=False) == []
