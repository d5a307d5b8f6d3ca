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
