"""Group updates (``shared.metrics``: ``Tally``, ``observe_many``) leave exactly what one
update per request leaves."""

from __future__ import annotations

import math
import random

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest

from shared.metrics import FleetMetrics, Tally, observe_many


def _samples(reg: CollectorRegistry) -> list[str]:
    """The exposition's lines, less ``_created`` (each series' creation time)."""
    return [
        line
        for line in generate_latest(reg).decode().splitlines()
        if "_created" not in line.split(" ")[0 if not line.startswith("#") else 2]
    ]


BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


def _hist() -> tuple[CollectorRegistry, Histogram]:
    reg = CollectorRegistry()
    return reg, Histogram("h_seconds", "h", ["m"], buckets=BUCKETS, registry=reg)


def test_observe_many_equals_one_observe_per_value() -> None:
    rng = random.Random(7)
    # on the bounds, between them, beyond the last finite one, negative, zero, NaN
    values = [*BUCKETS, 0.0, -0.5, 7.5, math.nan, *(rng.uniform(0, 6) for _ in range(200))]
    one, h1 = _hist()
    many, h2 = _hist()
    for v in values:
        h1.labels("x").observe(v)
    observe_many(h2.labels("x"), values)
    assert _samples(one) == _samples(many)


def test_tally_applies_counts_and_observations_once_per_child() -> None:
    reg = CollectorRegistry()
    c = Counter("c", "c", ["k"], registry=reg)
    reg2 = CollectorRegistry()
    c2 = Counter("c", "c", ["k"], registry=reg2)
    h = Histogram("h_seconds", "h", buckets=BUCKETS, registry=reg)
    h2 = Histogram("h_seconds", "h", buckets=BUCKETS, registry=reg2)
    t = Tally()
    for i in range(10):
        t.count(c.labels("a" if i % 3 else "b"))
        t.observe(h, i / 10)
        c2.labels("a" if i % 3 else "b").inc()
        h2.observe(i / 10)
    assert reg.get_sample_value("c_total", {"k": "a"}) == 0.0  # nothing before apply
    t.apply()
    assert _samples(reg) == _samples(reg2)
    t.apply()  # emptied: applying again adds nothing
    assert _samples(reg) == _samples(reg2)


def test_a_group_of_requests_equals_each_request_alone() -> None:
    rows = [
        ("bulk", "ok", 0.01, 0.2, "text", 0.04),
        ("bulk", "DEADLINE_EXCEEDED", None, 2.5, "text", None),
        ("realtime", "ok", 0.002, 0.01, "text.realtime", 0.003),
        ("bulk", "REVOKED", None, None, "other", None),
        ("bulk", "ok", 0.03, 0.3, "text", 0.04),
    ]
    alone = FleetMetrics("text", "minilm", "text@h", enabled=True)
    group = FleetMetrics("text", "minilm", "text@h", enabled=True)
    for r in rows:
        alone.observe_request(*r)
    group.observe_requests(rows)
    assert _samples(alone.registry) == _samples(group.registry)
    alone.eco.started(["text", "text", "text.realtime"])
    group.eco.started(["text", "text.realtime", "text"])
    assert _samples(alone.registry) == _samples(group.registry)


def test_a_large_mixed_group_equals_each_request_alone() -> None:
    """Rows of many label sets, interleaved (the children a label set updates are found once
    per set; a child several sets share, e.g. a priority's queue wait, keeps its values in
    row order)."""
    rng = random.Random(11)
    codes = ["ok", "ok", "ok", "DEADLINE_EXCEEDED", "MODEL_ERROR", "REVOKED"]
    rows = [
        (
            rng.choice(["bulk", "normal", "realtime", "unknown"]),
            rng.choice(codes),
            rng.choice([None, rng.uniform(0, 2)]),
            rng.choice([None, rng.uniform(0, 9)]),
            rng.choice(["text", "text.realtime", "other", "minilm.q"]),
            rng.choice([None, rng.uniform(0, 1)]),
        )
        for _ in range(400)
    ]
    models = {"minilm.q": "other-model"}
    alone = FleetMetrics("text", "minilm", "text@h", enabled=True, queue_models=models)
    group = FleetMetrics("text", "minilm", "text@h", enabled=True, queue_models=models)
    for r in rows:
        alone.observe_request(*r)
    group.observe_requests(rows)
    assert _samples(alone.registry) == _samples(group.registry)


def test_requests_after_a_hostname_change_carry_the_new_hostname() -> None:
    m = FleetMetrics("text", "minilm", "text@h", enabled=True)
    row = ("bulk", "ok", 0.01, 0.2, "text", 0.04)
    m.observe_requests([row])
    m.eco.set_hostname("text@other")
    m.observe_requests([row, row])
    labels = {"name": "fleet.text", "queue_name": "text", "hostname": "text@other"}
    assert m.registry.get_sample_value("celery_task_runtime_count", labels) == 2
    assert m.registry.get_sample_value("celery_task_succeeded_total", labels) == 2
