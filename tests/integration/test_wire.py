"""producer.client.wire builds the messages kombu would push for a request (the gateway pushes them
with redis.asyncio, FleetClient.submit_many in pipelined transactions): the same message,
field for field and value for value (but Flower's kwargs summary), as FleetClient.publish's,
read back from a real Redis (no worker, so nothing consumes the queue)."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery.events.receiver import EventReceiver

from producer.client import FleetClient, SubmitRequest
from producer.client.fleet import CHUNK
from producer.client.wire import envelope_json, kwargs_summary
from shared import schema
from shared.celery_app import make_app
from shared.errors import QueueFull
from shared.schema import Priority
from shared.settings import load_settings
from tests.conftest import own_redis

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def redis_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with own_redis(tmp_path_factory, "wire-run") as st:
        yield st


def _decoded(raw: bytes) -> dict[str, Any]:
    msg = json.loads(raw)
    msg["body"] = json.loads(base64.b64decode(msg["body"]))
    return msg


INPUTS = [
    ("text", {"text": "the same words"}, "bulk", None),
    ("text", {"text": 'h\u00e9 "quoted" \\ \u4e2d \U0001f600'}, "bulk", 5),
    ("text", {"text": "x", "n": [1.5, None, True, 10**20, -0.0, 1e-7]}, "realtime", None),
    ("image", {"image_b64": "AAAA"}, "high", None),
]


@pytest.mark.parametrize("case", INPUTS, ids=["plain", "unicode", "numbers", "image"])
def test_the_payload_equals_kombus_but_for_ids_and_the_summary(redis_only: Any, case: Any) -> None:
    client = FleetClient(redis_only.s)
    admin = redis.Redis.from_url(redis_only.s.redis_url("admin"))
    env = client.envelope(*case)
    prio = Priority.parse(env.priority).celery_priority(client.settings)
    queue = schema.queue_for(env.modality, env.priority)
    key = schema.priority_list_key(queue, prio)
    try:
        with client.app.producer_or_acquire() as producer:
            client.publish(producer, env, "id-kombu", queue, prio)
        for _ in range(2):  # the template's first use and a later one
            list_key, payload = client.payloads().payload(
                env, "id-wire", queue, prio, str(client.app.thread_oid)
            )
            assert list_key == key
            assert client.app.backend.client.lpush(list_key, payload) >= 2  # as the producer
        ours, again, kombus = (_decoded(m) for m in admin.lrange(key, 0, -1))  # newest first
        assert list(ours) == list(kombus)  # same keys, same order (properties last)
        assert list(ours["properties"]) == list(kombus["properties"])
        assert ours["properties"]["delivery_tag"] != again["properties"]["delivery_tag"]
        for msg, tid in ((ours, "id-wire"), (again, "id-wire"), (kombus, "id-kombu")):
            assert msg["headers"].pop("id") == msg["headers"].pop("root_id") == tid
            assert msg["properties"].pop("correlation_id") == tid
            msg["properties"].pop("delivery_tag")
        # Flower's kwargs column: a summary, never the inputs (kombu's is Celery's saferepr)
        summary = kwargs_summary(env)
        assert ours["headers"].pop("kwargsrepr") == again["headers"].pop("kwargsrepr") == summary
        assert kombus["headers"].pop("kwargsrepr") != summary
        assert ours == again == kombus
        assert ours["body"][1] == {"request": json.loads(env.model_dump_json())}
    finally:
        admin.delete(key)
        client.close()


@pytest.mark.parametrize("case", INPUTS, ids=["plain", "unicode", "numbers", "image"])
def test_the_envelope_json_is_pydantics_json_dump(case: Any, redis_only: Any) -> None:
    client = FleetClient(redis_only.s)
    try:
        env = client.envelope(*case)
        got = envelope_json(env)
        assert json.loads(got) == env.model_dump(mode="json")
        assert list(json.loads(got)) == list(env.model_dump(mode="json"))  # field order too
    finally:
        client.close()


def _untagged(payload: bytes) -> bytes:
    """``payload`` with its delivery tag replaced by a fixed string."""
    tag = json.loads(payload)["properties"]["delivery_tag"]
    return payload.replace(tag.encode(), b"TAG")


def _lists(admin: redis.Redis) -> dict[str, list[bytes]]:
    """Every text priority list that holds messages, oldest message first."""
    out = {}
    for q in ("text", "text.realtime"):
        for p in schema.PRIORITY_STEPS:
            key = schema.priority_list_key(q, p)
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
                if schema.priority_list_key(
                    schema.queue_for("text", h.envelope.priority),
                    Priority.parse(h.envelope.priority).celery_priority(client.settings),
                )
                == key
            ]
            assert got == want, key
        # the bytes are the message of one request (what the gateway pushes in its job's
        # transaction: ClientBase.message), the delivery tag apart
        first = json.loads(lists[schema.priority_list_key("text", 9)][0])
        h = handles[0]
        ref = client.message(h.envelope, h.id)
        raw = lists[schema.priority_list_key("text", 9)][0]
        assert ref.key == schema.priority_list_key("text", 9) and ref.event is None
        assert first["headers"]["id"] == h.id and _untagged(raw) == _untagged(ref.payload)
    finally:
        admin.delete(*_lists(admin))
        client.close()


def test_submit_many_sends_kombus_task_sent_events_as_one_group(redis_only: Any) -> None:
    """The events the exporter counts (celery_task_sent_total): each as kombu's publish makes
    it, field for field, a chunk's events in one message (a list body, as Celery's grouped
    events) on the same channel; a real Celery EventReceiver takes every one (the next
    test)."""
    client = FleetClient(redis_only.s)
    admin = redis.Redis.from_url(redis_only.s.redis_url("admin"))
    sub = admin.pubsub()
    sub.psubscribe("*celeryev/task.sent")
    assert sub.get_message(timeout=2)["type"] == "psubscribe"
    try:
        env = client.envelope("text", {"text": "evented"}, "bulk", None)
        with client.app.producer_or_acquire() as producer:
            client.publish(producer, env, "id-kombu", "text", 9)
        hs = client.submit_many([SubmitRequest("text", {"text": "evented"}, "bulk")] * 3)
        got = [sub.get_message(timeout=2) for _ in range(2)]
        assert got[0]["channel"] == got[1]["channel"]
        assert sub.get_message(timeout=0.5) is None  # one message for the chunk's three
        kombus, ours = _decoded(got[0]["data"]), json.loads(got[1]["data"])
        assert list(ours) == list(kombus) and ours["headers"] == kombus["headers"]
        # the group's body is the events' list itself, handed on by kombu as it is
        # (application/data), not base64 of JSON: the one difference from kombu's message
        assert (ours["content-type"], ours["content-encoding"]) == ("application/data", "binary")
        assert kombus["properties"].pop("body_encoding") == "base64"
        for msg in (ours, kombus):
            assert msg["properties"].pop("delivery_tag")
        assert ours["properties"] == kombus["properties"]
        assert [e["uuid"] for e in ours["body"]] == [h.id for h in hs]
        clocks = [e["clock"] for e in ours["body"]]
        assert clocks == sorted(clocks) and clocks[0] > kombus["body"]["clock"]
        ref = kombus["body"]
        for event, h in zip(ours["body"], hs, strict=True):
            assert list(event) == list(ref)
            assert event["uuid"] == event["root_id"] == h.id
            assert event["kwargs"] == kwargs_summary(h.envelope)
            for k in ("clock", "timestamp", "uuid", "root_id", "kwargs"):
                event.pop(k)
        for k in ("clock", "timestamp", "uuid", "root_id", "kwargs"):
            ref.pop(k)
        assert all(event == ref for event in ours["body"])
    finally:
        sub.close()
        admin.delete("text\x06\x169")
        client.close()


def test_a_celery_event_receiver_counts_every_grouped_task_sent_event(redis_only: Any) -> None:
    """What Flower and ``fleet exporter`` do: Celery's EventReceiver, bound to ``task.sent``,
    gets each request of a submit_many (two chunks) as one ``task-sent`` event."""
    client = FleetClient(redis_only.s)
    admin = redis.Redis.from_url(redis_only.s.redis_url("admin"))
    seen: list[str] = []
    n = CHUNK + 7
    tap_app = make_app(redis_only.s, name="test-tap", role="operator")  # as fleet exporter's
    conn = tap_app.connection_for_read()
    recv = EventReceiver(
        conn,
        handlers={"task-sent": lambda e: seen.append(e["uuid"])},
        routing_key="task.sent",
        app=tap_app,
    )
    tap = threading.Thread(target=recv.capture, kwargs={"wakeup": False}, daemon=True)
    tap.start()
    try:
        probe = client.envelope("text", {"text": "probe"}, "bulk", None)
        deadline = time.monotonic() + 10
        while "probe" not in seen and time.monotonic() < deadline:  # until it listens
            with client.app.producer_or_acquire() as producer:
                client.publish(producer, probe, "probe", "text", 9)
            time.sleep(0.2)
        assert "probe" in seen
        seen.clear()
        hs = client.submit_many(SubmitRequest("text", {"text": f"e {i}"}) for i in range(n))
        while len(seen) < n and time.monotonic() < deadline + 10:
            time.sleep(0.05)
        assert [i for i in seen if i != "probe"] == [h.id for h in hs]
    finally:
        recv.should_stop = True
        tap.join(timeout=5)
        conn.release()
        admin.delete(*_lists(admin))
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


@pytest.mark.parametrize("case", INPUTS, ids=["plain", "unicode", "numbers", "image"])
def test_the_message_from_the_validated_inputs_json_equals_the_one_built_from_the_envelope(
    redis_only: Any, case: Any
) -> None:
    """submit_many builds from the JSON its validation wrote (one serialization of the
    inputs, orjson's for the envelope; json's where orjson leaves a value aside, here the
    integer beyond 64 bits); the gateway and ``payload`` from the envelope alone."""
    client = FleetClient(redis_only.s)
    try:
        env, data = client._validated(*case)
        route = {(env.modality, env.priority, env.model): ("q", 3)}
        builder = client.payloads()
        fast = builder.build_many([(env, "tid", data)], route, "r", True)[0]
        slow = builder.build_many([(env, "tid", None)], route, "r", True)[0]
        assert fast.key == slow.key == schema.priority_list_key("q", 3)
        a, b = _decoded(fast.payload), _decoded(slow.payload)
        assert a["properties"].pop("delivery_tag") != b["properties"].pop("delivery_tag")
        assert a == b and a["body"][1] == {"request": env.model_dump(mode="json")}
        ev_a, ev_b = json.loads(fast.event), json.loads(slow.event)  # type: ignore[arg-type]
        assert ev_b["clock"] == ev_a["clock"] + 1
        for ev in (ev_a, ev_b):
            ev.pop("clock"), ev.pop("timestamp")
        assert ev_a == ev_b
    finally:
        client.close()


def test_a_chunk_sent_before_its_successor_fails_to_build_is_counted_then_the_error_raised(
    redis_only: Any,
) -> None:
    """publish_many sends a chunk, then builds the next one while Redis takes it: when that
    building fails, the sent chunk is still read back and yielded (on Redis: its requests
    must have handles), and the error comes out after it."""
    client = FleetClient(redis_only.s)
    admin = redis.Redis.from_url(redis_only.s.redis_url("admin"))
    envs = [client.envelope("text", {"text": f"chunked {i}"}, "bulk") for i in range(25)]
    ids = [f"id-{i}" for i in range(25)]
    good = list(client.outgoing(envs, ids))

    def messages() -> Iterator[Any]:
        yield from good[:20]
        raise RuntimeError("the 21st message could not be built")

    try:
        sent = client.publish_many(messages(), chunk=10)
        assert next(sent) == 10
        assert next(sent) == 20  # sent before the failing build of the third chunk
        with pytest.raises(RuntimeError, match="21st"):
            next(sent)
        lists = _lists(admin)
        got = [json.loads(m)["headers"]["id"] for m in lists[schema.priority_list_key("text", 9)]]
        assert got == ids[:20]
    finally:
        admin.delete(*_lists(admin))
        client.close()
