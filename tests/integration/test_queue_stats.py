"""shared.queue_stats' script on a real Redis: waiting per priority list, reserved messages
attributed to their queue from kombu's unacked entries (both formats that write them), and
the oldest submit time from the ``fleet_submitted_ms`` header only.

Runs on the session stack's Redis in a database of its own (db 8): no worker reads it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from shared import schema
from shared.queue_stats import SUBMITTED_HEADER, QueueReader

pytestmark = pytest.mark.integration

QUEUES = ["text", "text.realtime", "image"]


@pytest.fixture()
def r(stack: Any, fleet_settings: Any) -> Iterator[redis.Redis]:
    url = fleet_settings.redis_url().rsplit("/", 1)[0] + "/8"
    client = redis.Redis.from_url(url, socket_timeout=5)
    client.flushdb()
    yield client
    client.flushdb()


def _payload(queue: str, sent_ms: float | None, text: str = "") -> dict[str, Any]:
    headers: dict[str, Any] = {"task": "fleet.text", "id": "x", "kwargsrepr": text}
    if sent_ms is not None:
        headers[SUBMITTED_HEADER] = sent_ms
    return {
        "body": "e30=",
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": {
            "delivery_info": {"exchange": "", "routing_key": queue},
            "delivery_tag": f"tag-{queue}-{sent_ms}",
        },
    }


def test_waiting_reserved_and_oldest_per_queue(r: redis.Redis) -> None:
    # Waiting: text at steps 0 and 6 (oldest at the tail: LPUSH, served from the right).
    r.lpush(schema.priority_list_key("text", 6), json.dumps(_payload("text", 5000.0)))
    r.lpush(schema.priority_list_key("text", 6), json.dumps(_payload("text", 6000.0)))
    r.lpush(schema.priority_list_key("text", 0), json.dumps(_payload("text", 7000.0)))
    r.lpush(schema.priority_list_key("text.realtime", 0), json.dumps(_payload("x", None)))
    # Reserved, as kombu's QoS.append writes an entry (", " separators) ...
    kombu_entry = json.dumps([_payload("text", 4000.0), "", "text"])
    # ... and as the fetch script writes one (no spaces); a text that quotes the header
    # name inside a string must not be read as the header.
    quoted = '{"fleet_submitted_ms": 1}'
    take_entry = (
        "[" + json.dumps(_payload("image", 9000.0, quoted), separators=(",", ":")) + ',"","image"]'
    )
    r.hset(schema.UNACKED_KEY, "a", kombu_entry)
    r.hset(schema.UNACKED_KEY, "b", take_entry)
    r.hset(schema.UNACKED_KEY, "c", json.dumps([_payload("text", None), "", "text"]))
    r.hset(schema.UNACKED_KEY, "d", json.dumps([_payload("video", 1.0), "", "video"]))

    stats, other = QueueReader(r, QUEUES).read()
    by = {s.queue: s for s in stats}
    assert other == 1  # the video entry: not a queue asked about
    text = by["text"]
    assert text.waiting[0] == 1 and text.waiting[6] == 2 and text.waiting_total == 3
    assert text.reserved == 2 and text.demand == 5
    assert text.oldest_submitted_ms == 4000.0  # the reserved one is the oldest
    rt = by["text.realtime"]
    assert rt.waiting_total == 1 and rt.reserved == 0 and rt.oldest_submitted_ms is None
    image = by["image"]
    assert image.waiting_total == 0 and image.reserved == 1
    assert image.oldest_submitted_ms == 9000.0  # not the quoted 1
    assert image.oldest_age_s(now_s=19.0) == 10.0


def test_empty_queues_read_as_zero(r: redis.Redis) -> None:
    stats, other = QueueReader(r, QUEUES).read()
    assert other == 0
    for s in stats:
        assert s.demand == 0 and s.oldest_submitted_ms is None and s.oldest_age_s() == 0.0
