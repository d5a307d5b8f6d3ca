"""producer.wire builds the bytes kombu would push for a request (the gateway pushes them
with redis.asyncio): the same message, field for field (but Flower's kwargs summary), as
FleetClient.publish's, read back from a real Redis (no worker, so nothing consumes the
queue)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from producer.client import FleetClient
from producer.stack import Stack, isolated_environment
from producer.wire import kwargs_summary, task_payload
from shared import keys

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
