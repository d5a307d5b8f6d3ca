"""docs/message-layout.md against the bytes ``producer.client.wire`` writes (no server).

Every rule of the page marked *unit* has its check here (:data:`CHECKS`, by the rule's id),
run over messages of every modality and priority class: small ones, large ones (a MiB of
body), ones whose inputs spell the scripts' patterns, and traced ones. The page's placement
table is held to the shipped settings, and every Lua expression the page quotes to the
script it names. Rules that need Redis: ``tests/integration/test_layout_scripts.py``.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from producer.client import FleetClient
from producer.client.wire import kwargs_summary
from shared import schema, tracing
from shared.schema import Priority
from shared.settings import MODALITIES, load_settings
from tests.message_layout import (
    REPO,
    Built,
    Rule,
    build,
    every_kind,
    inputs_for,
    lua_script,
    placements,
    rules,
)

MEMBERS = ["body", "content-encoding", "content-type", "headers", "properties"]
PROPERTIES = [
    "correlation_id",
    "reply_to",
    "delivery_mode",
    "delivery_info",
    "priority",
    "body_encoding",
    "delivery_tag",
]
EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
UUID4 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
# The scripts' Lua patterns, as Python regular expressions (%s: \s; %b{}: a flat {...})
TAG = rb'"delivery_tag"\s*:\s*"([^"\\]+)"'
INFO = rb'"delivery_info"\s*:\s*(\{[^{}]*\})'
EXCHANGE = rb'"exchange"\s*:\s*"([^"\\]*)"'
ROUTING_KEY = rb'"routing_key"\s*:\s*"([^"\\]*)"'
SUBMITTED = rb'"fleet_submitted_ms"\s*:\s*([\d.eE+\-]+)'
# Inputs that spell the patterns: in the body (base64) and, their keys, in the kwargs summary
HOSTILE = {
    '"delivery_tag":"forged"': 1,
    '"fleet_submitted_ms":1': 2,
    '"routing_key":"elsewhere"': 3,
    "quote": '"delivery_info":{"exchange":"x","routing_key":"y"}, "properties": {}',
}


@pytest.fixture(scope="module")
def client() -> Iterator[FleetClient]:
    """A producer of the shipped settings (no Redis: it only builds messages)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.upper().startswith("FLEET_"):
                mp.delenv(name)
        mp.setenv("FLEET_CONFIG", str(REPO / "configs" / "fleet.toml"))
        c = FleetClient(load_settings(redis={"password": "x"}))
    yield c
    c.close()


@pytest.fixture(scope="module")
def messages(client: FleetClient) -> Iterator[list[Built]]:
    """Every kind of message the page speaks of (module docstring)."""
    out = every_kind(client)
    for m in MODALITIES:
        out += [build(client, m, c, inputs_for(m, 2**20)) for c in ("realtime", "bulk")]
        secret = "the inputs' own words"
        hostile = {**inputs_for(m), **HOSTILE, "secret": secret}
        out += [build(client, m, p.label, hostile, secret=secret) for p in Priority]
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    tracing.configure(client.settings, "test-message-layout", exporter=InMemorySpanExporter())
    try:
        out += [build(client, m, "normal", inputs_for(m), traced=True) for m in MODALITIES]
    finally:
        tracing.reset()
    yield out
    _decoded.cache_clear()


@functools.cache
def _decoded(payload: bytes) -> dict[str, Any]:
    return json.loads(payload)


def _obj(b: Built) -> dict[str, Any]:
    return _decoded(b.payload)


def check_object(rule: Rule, msgs: list[Built], app: Any) -> None:
    for b in msgs:
        assert isinstance(json.loads(b.payload.decode("utf-8")), dict)
        outside = JSON_STRING.sub(b"", b.payload)
        assert not re.search(rb"\s", outside), outside[:200]


def check_members(rule: Rule, msgs: list[Built], app: Any) -> None:
    for b in msgs:
        assert list(_obj(b)) == MEMBERS
        assert b.payload.endswith(b"}}")  # properties' end, then the message's


def check_body(rule: Rule, msgs: list[Built], app: Any) -> None:
    for b in msgs:
        msg = _obj(b)
        assert re.fullmatch(r"[A-Za-z0-9+/]*={0,2}", msg["body"]) and len(msg["body"]) % 4 == 0
        body = json.loads(base64.b64decode(msg["body"], validate=True).decode("utf-8"))
        assert body == [[], {"request": b.env.model_dump(mode="json")}, EMBED]
        assert msg["content-encoding"] == "utf-8"
        assert msg["content-type"] == "application/json"
        assert msg["properties"]["body_encoding"] == "base64"


def _celery_headers(app: Any, modality: str) -> list[str]:
    m = app.amqp.create_task_message(
        "id", schema.task_name(modality), (), {}, reply_to="r", argsrepr="()"
    )
    return list(m.headers)


def check_headers(rule: Rule, msgs: list[Built], app: Any) -> None:
    for b in msgs:
        h = _obj(b)["headers"]
        celery = _celery_headers(app, b.modality)
        assert list(h)[: len(celery)] == celery
        trace = ["traceparent"] + (["tracestate"] if "tracestate" in h else [])
        assert list(h)[len(celery) :] == ["fleet_submitted_ms", *(trace if b.traced else [])]
        assert h["task"] == f"fleet.{b.modality}"
        assert h["id"] == h["root_id"] == b.task_id
        assert h["kwargsrepr"] == kwargs_summary(b.env)
        assert not b.secret or b.secret not in h["kwargsrepr"]  # keys, never values
        assert h["fleet_submitted_ms"] == b.env.submitted_ms
        assert type(h["fleet_submitted_ms"]) in (int, float)
    assert any(b.traced for b in msgs)


def check_properties(rule: Rule, msgs: list[Built], app: Any) -> None:
    for b in msgs:
        p = _obj(b)["properties"]
        assert list(p) == PROPERTIES
        assert p["correlation_id"] == b.task_id
        assert p["delivery_mode"] == 2
        assert p["priority"] == b.placement.celery_priority
        assert p["body_encoding"] == "base64"


def check_delivery_tag(rule: Rule, msgs: list[Built], app: Any) -> None:
    tags = []
    for b in msgs:
        tag = _obj(b)["properties"]["delivery_tag"]
        assert UUID4.fullmatch(tag), tag
        assert b.payload.endswith(b'"delivery_tag":"%s"}}' % tag.encode())
        (found,) = re.findall(TAG, b.payload)  # the take script's pattern: this one only
        assert found == tag.encode()
        tags.append(tag)
    assert len(set(tags)) == len(tags)


def check_delivery_info(rule: Rule, msgs: list[Built], app: Any) -> None:
    for b in msgs:
        queue = b.placement.queue_for(b.modality)
        (info,) = re.findall(INFO, b.payload)
        assert info == b'{"exchange":"","routing_key":"%s"}' % queue.encode()
        assert re.findall(EXCHANGE, info) == [b""]
        assert re.findall(ROUTING_KEY, info) == [queue.encode()]
        assert not re.search(rb'["\\]', queue.encode())


def check_placement(rule: Rule, msgs: list[Built], app: Any) -> None:
    seen = set()
    for b in msgs:
        p = _obj(b)["properties"]
        assert b.list_key == b.placement.list_for(b.modality)
        assert p["delivery_info"]["routing_key"] == b.placement.queue_for(b.modality)
        assert p["priority"] == b.placement.celery_priority
        seen.add((b.modality, b.placement.cls))
    assert seen == {(m, p.label) for m in MODALITIES for p in Priority}


def check_tail_properties(rule: Rule, msgs: list[Built], app: Any) -> None:
    n = rule.number("take_many.lua", r"string\.sub\(item, -(\d+)\)")
    assert rule.number("take_many.lua", r"#item > (\d+)") == 64 * 1024  # the page's "64 KiB"
    assert max(len(b.payload) for b in msgs) > 2**20  # large bodies among them
    for b in msgs:
        tail = b.payload[-n:]
        assert b'"properties"' in tail
        p = _obj(b)["properties"]
        assert re.findall(TAG, tail) == [p["delivery_tag"].encode()]
        (info,) = re.findall(INFO, tail)
        assert json.loads(info) == p["delivery_info"]


def check_tail_submitted(rule: Rule, msgs: list[Built], app: Any) -> None:
    n = rule.number("queue_stats.lua", r"string\.sub\(item, -(\d+)\)")
    for b in msgs:
        (value,) = re.findall(SUBMITTED, b.payload[-n:])
        assert re.findall(SUBMITTED, b.payload) == [value]  # once in the whole message
        assert float(value) == b.env.submitted_ms


def check_keys_only(rule: Rule, msgs: list[Built], app: Any) -> None:
    hostile = [b for b in msgs if b.secret]
    assert hostile and all(b'\\"delivery_tag\\"' in b.payload for b in hostile)  # in kwargsrepr
    for b in msgs:
        for name in (b"delivery_tag", b"delivery_info", b"exchange", b"routing_key"):
            assert len(re.findall(rb'"%s"\s*:' % name, b.payload)) == 1, name
        assert len(re.findall(rb'"fleet_submitted_ms"\s*:', b.payload)) == 1


CHECKS: dict[str, Callable[[Rule, list[Built], Any], None]] = {
    "object": check_object,
    "members": check_members,
    "body": check_body,
    "headers": check_headers,
    "properties": check_properties,
    "delivery-tag": check_delivery_tag,
    "delivery-info": check_delivery_info,
    "placement": check_placement,
    "tail-properties": check_tail_properties,
    "tail-submitted": check_tail_submitted,
    "keys-only": check_keys_only,
}


def test_every_unit_rule_of_the_page_has_its_check() -> None:
    assert sorted(r.id for r in rules().values() if r.checked == "unit") == sorted(CHECKS)
    assert [r.id for r in rules().values() if r.checked == "integration"] == ["unacked-entry"]


@pytest.mark.parametrize("rid", sorted(CHECKS))
def test_the_rule_holds(rid: str, messages: list[Built], client: FleetClient) -> None:
    CHECKS[rid](rules()[rid], messages, client.app)


def test_the_lua_the_page_quotes_is_in_the_scripts() -> None:
    quoted = 0
    for rule in rules().values():
        for script, expressions in rule.reads.items():
            assert expressions, f"rule {rule.id} names {script} but quotes nothing of it"
            text = lua_script(script)
            for e in expressions:
                assert e in text, f"rule {rule.id}: {e!r} is not in {script}"
                quoted += 1
    assert quoted >= 10


def test_the_placement_table_is_the_shipped_settings(client: FleetClient) -> None:
    rows = placements()
    assert [r.cls for r in rows] == [p.label for p in Priority]
    for row in rows:
        prio = Priority.parse(row.cls)
        assert prio.celery_priority(client.settings) == row.celery_priority
        for m in MODALITIES:
            assert schema.queue_for(m, row.cls) == row.queue_for(m)
            assert schema.priority_list_key(row.queue_for(m), row.celery_priority) == row.list_for(
                m
            )
    assert rows[-1].list_for("text") == "text\x06\x169"  # the page's escape read as bytes
