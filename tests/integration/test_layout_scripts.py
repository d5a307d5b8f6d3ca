"""docs/message-layout.md's rules that need Redis: the real take script and the exporter's
queue read, on messages ``producer.client.wire`` built for every modality and priority class
(no worker: the script is run as ``workers.consumer.channel.Channel`` runs it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from producer.client import FleetClient
from shared import schema
from shared.queue_stats import QueueReader
from shared.settings import MODALITIES
from tests.conftest import own_redis
from tests.message_layout import Built, build, every_kind, inputs_for, queues, rules
from workers.consumer.channel import TAKE_MANY

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def redis_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with own_redis(tmp_path_factory, "layout-run") as st:
        yield st


def test_taken_messages_are_unacked_entries_the_exporter_reads(redis_only: Any) -> None:
    assert rules()["unacked-entry"].checked == "integration"
    client = FleetClient(redis_only.s)
    admin = redis.Redis.from_url(redis_only.s.redis_url("admin"))
    try:
        built = every_kind(client)
        built += [build(client, m, "bulk", inputs_for(m, 300_000)) for m in MODALITIES]
        for b in built:
            admin.lpush(b.list_key, b.payload)
        reader = QueueReader(admin, queues())
        waiting, _ = reader.read()
        oldest = {
            q: math.floor(min(b.env.submitted_ms for b in built if _queue(b) == q))
            for q in queues()
        }
        assert {s.queue: s.oldest_submitted_ms for s in waiting} == oldest

        # every list, priority step first (as a channel's BRPOP names them), then kombu's
        lists = [schema.priority_list_key(q, p) for p in schema.PRIORITY_STEPS for q in queues()]
        take = admin.register_script(TAKE_MANY)
        flat = take(
            keys=[*lists, schema.UNACKED_KEY, schema.UNACKED_INDEX_KEY],
            args=[len(built) + 1, "1234.5", 0],
        )
        taken = dict(zip(flat[1::2], flat[0::2], strict=True))  # message -> its list
        assert len(taken) == len(built)
        for b in built:
            assert taken[b.payload] == b.list_key.encode()  # byte for byte, from its list
            tag = json.loads(b.payload)["properties"]["delivery_tag"]
            entry = admin.hget(schema.UNACKED_KEY, tag)
            assert entry == b"[" + b.payload + b',"","' + _queue(b).encode() + b'"]'
            assert json.loads(entry)[2] == _queue(b)  # the entry's last JSON string
            assert admin.zscore(schema.UNACKED_INDEX_KEY, tag) == 1234.5

        reserved, other = reader.read()
        assert other == 0
        for before, after in zip(waiting, reserved, strict=True):
            assert after.waiting_total == 0
            assert after.reserved == before.waiting_total
            assert after.reserved == sum(_queue(b) == after.queue for b in built) > 0
        assert {s.queue: s.oldest_submitted_ms for s in reserved} == oldest
    finally:
        admin.flushdb()
        client.close()


def _queue(b: Built) -> str:
    return b.placement.queue_for(b.modality)


def test_the_take_reads_every_spelling_of_the_tail_the_same(redis_only: Any) -> None:
    """The take's plain searches read the compact tail the fleet's producers write; a message
    spelt otherwise (kombu's publish: a blank after each ``,`` and ``:``; a message kombu
    restored: ``redelivered`` inside ``delivery_info``) is read by its patterns instead, and
    every spelling gives the same unacked entry: the message byte for byte, its exchange and
    routing key."""
    client = FleetClient(redis_only.s)
    admin = redis.Redis.from_url(redis_only.s.redis_url("admin"))
    try:
        compact = build(client, "text", "bulk", inputs_for("text", 100)).payload
        doc = json.loads(compact)
        restored_doc = json.loads(compact)
        restored_doc["properties"]["delivery_info"]["redelivered"] = True
        restored_doc["properties"]["delivery_tag"] = "restored-tag"
        restored = json.dumps(restored_doc).encode()
        doc["properties"]["delivery_tag"] = "spaced-tag"
        spaced = json.dumps(doc).encode()  # kombu's spelling
        assert b'"delivery_tag":"' in compact and b'"delivery_tag":"' not in spaced
        key = "layout-spellings"
        admin.lpush(key, compact, spaced, restored)
        take = admin.register_script(TAKE_MANY)
        flat = take(keys=[key, schema.UNACKED_KEY, schema.UNACKED_INDEX_KEY], args=[10, "7", 0])
        assert flat[1::2] == [compact, spaced, restored]  # oldest first, each byte for byte
        tags = {
            json.loads(compact)["properties"]["delivery_tag"]: compact,
            "spaced-tag": spaced,
            "restored-tag": restored,
        }
        for tag, payload in tags.items():
            entry = admin.hget(schema.UNACKED_KEY, tag)
            assert entry == b"[" + payload + b',"","text"]'
            assert admin.zscore(schema.UNACKED_INDEX_KEY, tag) == 7.0
    finally:
        admin.flushdb()
        client.close()
