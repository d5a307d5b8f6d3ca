"""producer.wire builds the bytes kombu would push for a request (the gateway pushes them
with redis.asyncio, FleetClient.submit_many in pipelined transactions): the same message,
field for field (but Flower's kwargs summary), as FleetClient.publish's, read back from a real
Redis (no worker, so nothing consumes the queue)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from producer.client import FleetClient, SubmitRequest
from producer.client_publish import CHUNK
from producer.stack import Stack, isolated_environment
from producer.wire import PayloadBuilder, kwargs_summary, task_payload
from shared import keys
from shared.errors import QueueFull
from shared.priority import Priority
from shared.settings import load_settings

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def redis_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with isolated_environment(Path(tmp_path_factory.mktemp("wire-run"))) as settings:
        st = Stack(settings)
        st.up([], flower=False, gateway=False)
        try:
            yield st
        finally:
            st.down()


def _decoded(raw: bytes) -> dict[str, Any]:
    msg = json.loads(raw)
    msg["body"] = json.loads(base64.b64decode(msg["body"]))
    return msg


def test_the_payload_equals_kombus_but_for_the_delivery_tag(redis_only: Any) -> None:
    client = FleetClient(redis_only.s)
    admin = redis.Redis.from_url(redis_only.s.redis_url("admin"))
    try:
        env = client.envelope("text", {"text": "the same words"}, "bulk", None)
        prio = 9
        key = keys.priority_list_key("text", prio)
        with client.app.producer_or_acquire() as producer:
            client.publish(producer, env, "id-kombu", "text", prio)
        list_key, payload = task_payload(
            client.app, env, "id-wire", "text", prio, str(client.app.thread_oid)
        )
        assert list_key == key
        assert client.app.backend.client.lpush(list_key, payload) == 2  # as the producer
        ours, kombus = (_decoded(m) for m in admin.lrange(key, 0, -1))  # LPUSH: newest first
        assert list(ours) == list(kombus)  # same keys, same order (properties last)
        assert list(ours["properties"]) == list(kombus["properties"])
        for msg, tid in ((ours, "id-wire"), (kombus, "id-kombu")):
            assert msg["headers"].pop("id") == msg["headers"].pop("root_id") == tid
            assert msg["properties"].pop("correlation_id") == tid
            msg["properties"].pop("delivery_tag")
        # Flower's kwargs column: a summary, never the inputs (kombu's is Celery's saferepr)
        assert ours["headers"].pop("kwargsrepr") == kwargs_summary(env)
        assert "the same words" in kombus["headers"].pop("kwargsrepr")
        assert ours == kombus
        assert ours["body"][1] == {"request": json.loads(env.model_dump_json())}
    finally:
        admin.delete(key)
        client.close()


def _untagged(payload: bytes) -> bytes:
    """``payload`` with its delivery tag replaced by a fixed string."""
    tag = json.loads(payload)["properties"]["delivery_tag"]
    return payload.replace(tag.encode(), b"TAG")


def test_the_builder_makes_task_payloads_bytes_but_for_the_tag(redis_only: Any) -> None:
    client = FleetClient(redis_only.s)
    builder = PayloadBuilder(client.app)
    try:
        cases = [
            (client.envelope("text", {"text": 'h\u00e9 "quoted" \\ \u4e2d'}, "bulk", 5), 'id"1'),
            (client.envelope("text", {"text": "x", "n": [1.5, None, True]}, "realtime"), "id2"),
            (client.envelope("image", {"image_b64": "AAAA"}, "high", None), "id3"),
        ]
        for env, tid in cases:
            prio = Priority.parse(env.priority).celery_priority(client.settings)
            queue = keys.queue_for(env.modality, env.priority)
            for _ in range(2):  # the template's first use and a later one
                ref = task_payload(client.app, env, tid, queue, prio, "reply")
                got = builder.payload(env, tid, queue, prio, "reply")
                assert got[0] == ref[0] and _untagged(got[1]) == _untagged(ref[1])
    finally:
        client.close()


def _lists(admin: redis.Redis) -> dict[str, list[bytes]]:
    """Every text priority list that holds messages, oldest message first."""
    out = {}
    for q in ("text", "text.realtime"):
        for p in keys.PRIORITY_STEPS:
            key = keys.priority_list_key(q, p)
            if items := admin.lrange(key, 0, -1):
                out[key] = items[::-1]  # LPUSH: newest first; the consumer takes the oldest
    return out


def test_submit_many_sends_chunks_whole_and_in_order_per_priority(redis_only: Any) -> None:
    client = FleetClient(redis_only.s)
    admin = redis.Redis.from_url(redis_only.s.redis_url("admin"))
    prios = ["bulk", "normal", "realtime", "bulk", "high"]
    n = 2 * CHUNK + 17
    try:
        handles = client.submit_many(
            SubmitRequest("text", {"text": f"words {i}"}, prios[i % len(prios)]) for i in range(n)
        )
        assert len(handles) == n and len({h.id for h in handles}) == n
        lists = _lists(admin)
        assert sum(map(len, lists.values())) == n
        for key, items in lists.items():
            got = [json.loads(m)["headers"]["id"] for m in items]
            want = [
                h.id
                for h in handles
                if keys.priority_list_key(
                    keys.queue_for("text", h.envelope.priority),
                    Priority.parse(h.envelope.priority).celery_priority(client.settings),
                )
                == key
            ]
            assert got == want, key
        # the bytes are task_payload's (what the workers read), the delivery tag apart
        first = json.loads(lists[keys.priority_list_key("text", 9)][0])
        h = handles[0]
        ref = task_payload(client.app, h.envelope, h.id, "text", 9, str(client.app.thread_oid))
        raw = lists[keys.priority_list_key("text", 9)][0]
        assert first["headers"]["id"] == h.id and _untagged(raw) == _untagged(ref[1])
    finally:
        admin.delete(*_lists(admin))
        client.close()


def test_submit_many_sends_kombus_task_sent_events(redis_only: Any) -> None:
    """The events the exporter counts (celery_task_sent_total): as kombu's publish sends them,
    field for field, on the same channel."""
    client = FleetClient(redis_only.s)
    admin = redis.Redis.from_url(redis_only.s.redis_url("admin"))
    sub = admin.pubsub()
    sub.psubscribe("*celeryev/task.sent")
    assert sub.get_message(timeout=2)["type"] == "psubscribe"
    try:
        env = client.envelope("text", {"text": "evented"}, "bulk", None)
        with client.app.producer_or_acquire() as producer:
            client.publish(producer, env, "id-kombu", "text", 9)
        (h,) = client.submit_many([SubmitRequest("text", {"text": "evented"}, "bulk")])
        got = [sub.get_message(timeout=2) for _ in range(2)]
        assert got[0]["channel"] == got[1]["channel"]
        kombus, ours = (_decoded(m["data"]) for m in got)
        assert list(ours) == list(kombus) and ours["headers"] == kombus["headers"]
        for msg in (ours, kombus):
            assert msg["properties"].pop("delivery_tag")
        assert ours["properties"] == kombus["properties"]
        assert list(ours["body"]) == list(kombus["body"])
        assert ours["body"]["clock"] > kombus["body"]["clock"]
        assert ours["body"]["uuid"] == ours["body"]["root_id"] == h.id
        assert ours["body"]["kwargs"] == kwargs_summary(h.envelope)
        for body in (ours["body"], kombus["body"]):
            for k in ("clock", "timestamp", "uuid", "root_id", "kwargs"):
                body.pop(k)
        assert ours["body"] == kombus["body"]
    finally:
        sub.close()
        admin.delete("text\x06\x169")
        client.close()


def test_backpressure_refuses_the_whole_submission_before_sending(redis_only: Any) -> None:
    settings = load_settings(
        modalities={"text": {**redis_only.s.modalities["text"].model_dump(), "max_queue_length": 5}}
    )
    client = FleetClient(settings)
    admin = redis.Redis.from_url(redis_only.s.redis_url("admin"))
    try:
        client.submit_many([SubmitRequest("text", {"text": f"w {i}"}) for i in range(3)])
        with pytest.raises(QueueFull):
            client.submit_many([SubmitRequest("text", {"text": f"x {i}"}) for i in range(3)])
        assert sum(map(len, _lists(admin).values())) == 3  # none of the refused three
    finally:
        admin.delete(*_lists(admin))
        client.close()
