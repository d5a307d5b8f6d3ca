"""A real text worker whose result write runs on Redis but whose reply is lost (a proxy
closes the connection instead of passing it on, as a Redis shutting down does): the worker
retries the write, recognises its own, and the request ends once, as a success (before the
write token, the retry took the write for another copy's and acked the request as a
``DUPLICATE``: a right result, but no success counted)."""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

import pytest
import redis

from producer.client import FleetClient
from shared import schema
from tests.conftest import own_redis
from tests.netfaults import ReplyDropper
from workers.batching.completion import _WRITE_FIRST

pytestmark = pytest.mark.integration

WRITE_SHA = hashlib.sha1(_WRITE_FIRST.encode()).hexdigest()


def lines(st: Any, task_id: str, state: str) -> int:
    text = (st.logs / "worker-text.log").read_text(errors="replace")
    return len(re.findall(rf"request id={re.escape(task_id)} state={state}\b", text))


def test_a_result_write_whose_reply_is_lost_ends_as_one_success(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    with own_redis(tmp_path_factory, "lost-reply-run", {"FLEET_METRICS__PORT_BASE": "0"}) as st:
        admin = redis.Redis.from_url(st.s.redis_url("admin"))
        admin.script_load(_WRITE_FIRST)  # the write runs at once (no NOSCRIPT round first)
        proxy = ReplyDropper(st.s.redis.port, WRITE_SHA)
        try:
            monkeypatch.setenv("FLEET_REDIS__PORT", str(proxy.port))  # the worker's only
            st.start_worker("text")
            monkeypatch.undo()
            client = FleetClient(st.s)  # straight to Redis
            proxy.armed = True
            handle = client.submit("text", {"text": "A quiet river runs under the bridge."})
            out = handle.get(timeout_s=60)
            assert len(out["embedding"]) == 384
            assert proxy.dropped == 1

            deadline = time.monotonic() + 30
            while not lines(st, handle.id, r"\w+") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert lines(st, handle.id, "SUCCESS") == 1
            assert lines(st, handle.id, "DUPLICATE") == 0
            log = (st.logs / "worker-text.log").read_text(errors="replace")
            assert "storing 1 results failed" in log  # the lost reply was retried
            assert admin.hlen(schema.UNACKED_KEY) == 0  # and acked
            client.close()
        finally:
            proxy.close()
