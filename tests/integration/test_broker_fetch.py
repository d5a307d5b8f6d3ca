"""workers.consumer.channel: several messages per round trip, in priority order, none lost or
unacked.

Runs kombu consumers on the test stack's real Redis, in a database of its own (db 7) so the
stack's workers never see these queues.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

from shared import schema

pytestmark = pytest.mark.integration

QUEUE = "fetch-test"
OPTIONS = {"priority_steps": schema.PRIORITY_STEPS, "queue_order_strategy": "priority"}


@pytest.fixture()
def conn(stack: Any, fleet_settings: Any) -> Iterator[Connection]:
    with Connection(
        _db7(fleet_settings),
        transport="workers.consumer.channel:Transport",
        transport_options={**OPTIONS, "fetch_limit": 8},
    ) as c:
        c.default_channel.client.flushdb()
        yield c
        c.default_channel.client.flushdb()


def _db7(fleet_settings: Any) -> str:
    return fleet_settings.redis_url().rsplit("/", 1)[0] + "/7"


def _publish(conn: Connection, priorities: list[int]) -> None:
    queue = Queue(QUEUE, Exchange(QUEUE), QUEUE)
    producer = Producer(conn.default_channel, exchange=queue.exchange, routing_key=QUEUE)
    for i, pri in enumerate(priorities):
        producer.publish({"i": i, "pri": pri}, priority=pri, declare=[queue], serializer="json")


def _consume(conn: Connection, prefetch: int, on_message: Any, rounds: int) -> Any:
    """A consumer with a window of ``prefetch`` on a new channel; ``rounds`` event reads."""
    channel = conn.channel()
    channel.basic_qos(0, prefetch, False)
    consumer = Consumer(channel, queues=[Queue(QUEUE)], on_message=on_message, accept=["json"])
    consumer.consume()
    for _ in range(rounds):
        conn.drain_events(timeout=2)
    return channel


def test_one_round_trip_fills_the_window_in_priority_order(conn: Connection) -> None:
    # 12 messages, lowest priority first on the wire; the window (prefetch 6) takes the
    # six most urgent (priority 0 before 3 before 9), arrival order inside a priority.
    _publish(conn, [9, 9, 9, 3, 3, 0, 9, 0, 3, 9, 9, 9])
    seen: list[dict[str, int]] = []
    channel = _consume(conn, 6, lambda m: seen.append(m.payload), rounds=1)
    assert [m["pri"] for m in seen] == [0, 0, 3, 3, 3, 9]
    assert [m["i"] for m in seen] == [5, 7, 3, 4, 8, 0]
    assert channel.fetched_in_batches == 6
    redis = conn.default_channel.client  # the consumer's own waits on pushes
    # all six are unacked (a crash now would restore them), the other six still queued
    assert redis.hlen("unacked") == 6 and redis.zcard("unacked_index") == 6
    assert channel._size(QUEUE) == 6


def test_messages_acked_inside_the_handler_leave_no_unacked_entry(conn: Connection) -> None:
    # A request that fails at once is acked from inside the handler, while the rest of the
    # messages taken in the same round trip have not been handed over yet.
    _publish(conn, [6] * 5)
    seen: list[int] = []

    def ack_now(message: Any) -> None:
        seen.append(message.payload["i"])
        message.ack()

    channel = _consume(conn, 10, ack_now, rounds=1)
    assert seen == [0, 1, 2, 3, 4]
    assert channel.fetched_in_batches == 5
    assert (
        conn.default_channel.client.hlen("unacked") == 0
        and conn.default_channel.client.zcard("unacked_index") == 0
    )
    assert channel._size(QUEUE) == 0


def test_fetch_limit_bounds_each_round_trip(conn: Connection) -> None:
    _publish(conn, [6] * 20)
    seen: list[int] = []
    channel = _consume(conn, 100, lambda m: (seen.append(m.payload["i"]), m.ack()), rounds=2)
    # fetch_limit 8: two round trips take 16 messages, in arrival order
    assert seen == list(range(16))
    assert channel._size(QUEUE) == 4


def test_rejected_message_is_requeued_and_not_lost(conn: Connection) -> None:
    _publish(conn, [6] * 3)
    seen: list[int] = []

    def reject_first(message: Any) -> None:
        seen.append(message.payload["i"])
        if message.payload["i"] == 0:
            message.reject(requeue=True)
        else:
            message.ack()

    channel = _consume(conn, 10, reject_first, rounds=1)
    assert seen == [0, 1, 2]
    assert channel._size(QUEUE) == 1  # message 0 is back in Redis
    assert conn.default_channel.client.hlen("unacked") == 0


def test_unacked_entries_restore_the_messages_intact(conn: Connection, fleet_settings: Any) -> None:
    # A worker that dies holding unacked messages: once visibility_timeout (here 1 s) has
    # passed, kombu's scan puts every one back, payload unchanged, from the entries (and
    # index scores) the script wrote.
    _publish(conn, [6] * 5)
    with Connection(
        _db7(fleet_settings),
        transport="workers.consumer.channel:Transport",
        transport_options={**OPTIONS, "fetch_limit": 8, "visibility_timeout": 1},
    ) as dying:
        seen: list[dict[str, int]] = []
        channel = _consume(dying, 10, lambda m: seen.append(m.payload), rounds=1)
        redis = dying.default_channel.client  # the consumer's own waits on pushes
        assert len(seen) == 5 and channel._size(QUEUE) == 0 and redis.hlen("unacked") == 5
        channel.qos.restore_visible(num=10, interval=1)
        assert channel._size(QUEUE) == 0  # not yet: they are within the visibility timeout
        time.sleep(1.2)
        channel.qos.restore_visible(num=10, interval=1)
        assert channel._size(QUEUE) == 5 and redis.hlen("unacked") == 0
    again: list[dict[str, int]] = []
    _consume(conn, 10, lambda m: (again.append(m.payload), m.ack()), rounds=1)
    assert sorted(again, key=lambda m: m["i"]) == seen


def test_an_unreadable_message_stays_where_it_was(conn: Connection) -> None:
    _publish(conn, [6] * 2)
    # behind the two valid ones, in their priority's list
    conn.default_channel.client.lpush(schema.priority_list_key(QUEUE, 6), b"not json")
    _publish(conn, [6])
    seen: list[int] = []
    consumer = _consume(conn, 10, lambda m: (seen.append(m.payload["i"]), m.ack()), rounds=1)
    # the two before it were taken; the walk stopped there and left it next in line
    assert seen == [0, 1]
    assert conn.default_channel.client.lrange(schema.priority_list_key(QUEUE, 6), -1, -1) == [
        b"not json"
    ]
    assert consumer._size(QUEUE) == 2
    assert conn.default_channel.client.hlen("unacked") == 0


def test_a_byte_budget_bounds_each_round_trip(stack: Any, fleet_settings: Any) -> None:
    # ~1.4 MB messages (1 MiB bodies, base64), a 2.5 MiB budget: one round trip stops once
    # it has taken 2.5 MiB (two); the rest wait in Redis. (The stack's Redis has push
    # notifications on: every message is taken by the script, none by BRPOP.)
    with Connection(
        _db7(fleet_settings),
        transport="workers.consumer.channel:Transport",
        transport_options={**OPTIONS, "fetch_limit": 64, "fetch_max_bytes": int(2.5 * 2**20)},
    ) as c:
        c.default_channel.client.flushdb()
        queue = Queue(QUEUE, Exchange(QUEUE), QUEUE)
        producer = Producer(c.default_channel, exchange=queue.exchange, routing_key=QUEUE)
        blob = os.urandom(2**20)
        for i in range(6):
            producer.publish(blob, headers={"i": i}, declare=[queue], serializer="raw",
                             content_type="application/octet-stream")  # fmt: skip
        seen: list[int] = []
        channel = _consume(c, 10, lambda m: seen.append(m.headers["i"]), rounds=1)
        assert seen == [0, 1] and channel.fetched_in_batches == 2
        assert c.default_channel.client.hlen("unacked") == 2 and channel._size(QUEUE) == 4
        stored = [json.loads(e)[0] for e in c.default_channel.client.hvals("unacked")]
        assert all(base64.b64decode(m["body"]) == blob for m in stored)  # payloads intact
        c.default_channel.client.flushdb()


def test_a_message_whose_properties_are_not_last_is_still_recorded(conn: Connection) -> None:
    # Another client's JSON: compact, properties first. The script reads the tag from the
    # decoded payload (it is small) and records it as kombu would.
    _publish(conn, [6])
    redis = conn.default_channel.client
    key = schema.priority_list_key(QUEUE, 6)
    original = json.loads(redis.rpop(key))
    reordered = {"properties": original.pop("properties"), **original}
    redis.lpush(key, json.dumps(reordered, separators=(",", ":")))
    _publish(conn, [6])
    seen: list[int] = []
    _consume(conn, 10, lambda m: seen.append(m.payload["i"]), rounds=1)
    assert sorted(seen) == [0, 0] and conn.default_channel.client.hlen("unacked") == 2
    tags = {
        json.loads(e)[0]["properties"]["delivery_tag"]
        for e in conn.default_channel.client.hvals("unacked")
    }
    assert tags == {t.decode() for t in conn.default_channel.client.hkeys("unacked")}


def test_publishes_share_one_client_per_pool_and_all_arrive(conn: Connection) -> None:
    """kombu built a Redis client for every publish; the channel keeps one per pool: the
    same object each time, and every message still lands in its list."""
    ch = conn.default_channel
    with ch.conn_or_acquire() as a, ch.conn_or_acquire() as b:
        assert a is b and a.connection_pool is ch.pool
    given = object()
    with ch.conn_or_acquire(given) as c:
        assert c is given  # a caller's own client is used as given
    _publish(conn, [0] * 20)
    with ch.conn_or_acquire() as d:
        assert d is a
        assert int(d.llen(QUEUE)) == 20


def test_a_fanout_publish_is_the_message_kombu_would_write(conn: Connection) -> None:
    """Task events leave through the channel's fanout publish (written with orjson): a
    subscriber reads kombu's message, the event intact in its body."""
    ch = conn.default_channel
    exchange = Exchange("fanout-test", type="fanout")
    sub = ch.client.pubsub(ignore_subscribe_messages=True)
    sub.psubscribe("*fanout-test*")
    time.sleep(0.1)
    event = {"type": "task-succeeded", "uuid": "é-1", "runtime": 0.25, "clock": 7}
    Producer(ch, exchange=exchange).publish(event, serializer="json", declare=[exchange])
    got = None
    deadline = time.monotonic() + 5
    while got is None and time.monotonic() < deadline:
        got = sub.get_message(timeout=0.5)
    sub.close()
    assert got is not None
    message = json.loads(got["data"])
    assert message["content-type"] == "application/json"
    assert message["properties"]["body_encoding"] == "base64"
    assert json.loads(base64.b64decode(message["body"])) == event
