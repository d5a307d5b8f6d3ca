"""Label sets of the worker and exporter series stay bounded; queue-stats replies parse."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from producer.ops.exporter import all_queues, step_labels
from shared import schema
from shared.metrics import FleetMetrics
from shared.queue_stats import parse_rows
from shared.settings import load_settings


def test_a_routing_key_of_another_queue_is_labelled_other() -> None:
    m = FleetMetrics("text", "minilm", "text@h")
    assert m.eco.queue_label("text") == "text"
    assert m.eco.queue_label("text.realtime") == "text.realtime"
    assert m.eco.queue_label("image") == m.eco.queue_label(None) == "other"
    m.observe_request("normal", "ok", 0.01, 0.02, m.eco.queue_label("anything-" + "x" * 99))
    assert "anything-" not in generate_latest(m.registry).decode()


def test_counters_exist_at_zero_before_any_request() -> None:
    text = generate_latest(FleetMetrics("text", "minilm", "text@h").registry).decode()
    assert (
        'fleet_requests_total{modality="text",model="minilm",outcome="DEADLINE_EXCEEDED",'
        'priority="high"} 0.0' in text
    )
    assert (
        'celery_task_failed_total{hostname="text@h",name="fleet.text",queue_name="text.realtime"}'
        " 0.0" in text
    )


def test_the_node_name_relabels_the_worker_series() -> None:
    m = FleetMetrics("image", "resnet18", "image@boot")
    m.eco.bind(lambda: 3.0, lambda: 5.0)
    m.eco.set_hostname("image-1@host")
    text = generate_latest(m.registry).decode()
    assert 'celery_worker_up{hostname="image-1@host"} 1.0' in text
    assert 'celery_worker_tasks_active{hostname="image-1@host"} 3.0' in text
    assert "image@boot" not in text


def test_every_celery_step_has_one_priority_label() -> None:
    labels = step_labels(load_settings())
    assert set(labels) == set(schema.PRIORITY_STEPS)
    assert {"realtime", "high", "normal", "bulk"} <= set(labels.values())
    assert set(labels.values()) <= {"realtime", "high", "normal", "bulk", "other"}


def test_parse_rows_reads_each_queue_and_refuses_a_wrong_shape() -> None:
    queues = all_queues()
    rows = [[1, 0, 0, 0, 0, 0, 2, 0, 0, 0, 3, 1500] for _ in queues] + [[4]]
    stats, other = parse_rows(queues, rows)
    assert other == 4 and stats[0].demand == 6 and stats[0].oldest_submitted_ms == 1500.0
    rows[0][-1] = -1
    assert parse_rows(queues, rows)[0][0].oldest_submitted_ms is None
    with pytest.raises(ValueError):
        parse_rows(queues, rows[1:])
