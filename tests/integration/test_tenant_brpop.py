"""The worker's BRPOP fetch (``[redis] fetch_notify = false``, or a Redis without keyspace
notifications) with tenant lists (``shared.tenants``): a real Redis and text worker of the
module's own, requests of two ``[tenants]`` tenants and of none at REALTIME and BULK, every
one answered with its own result, REALTIME ahead of the BULK backlog, and nothing lost or
left in any list, the unacked hash or a tenant's ``max_queued`` set.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from producer.client import FleetClient, SubmitRequest
from shared import schema
from shared.tenant_quota import open_key
from tests.conftest import REPO, own_text_stack

pytestmark = pytest.mark.integration

TENANTS = ("acme", "other")


@pytest.fixture(scope="module")
def bstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    overrides = {
        "FLEET_CONFIG": str(REPO / "configs" / "fleet.toml"),
        "FLEET_REDIS__FETCH_NOTIFY": "false",  # kombu's BRPOP, on the tenant lists too
        "FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE": "8",
        "FLEET_MODALITIES__TEXT__BATCHING__LENGTH_BUCKETS": "[16]",
        "FLEET_METRICS__PORT_BASE": "0",
        "FLEET_TENANTS__ACME__MAX_QUEUED": "1000",
        "FLEET_TENANTS__OTHER__WEIGHT": "2",
    }
    with own_text_stack(tmp_path_factory, "tenant-brpop", overrides) as st:
        yield st


def words(n: int) -> str:
    """``n`` words, each one token of MiniLM's vocabulary: ``n + 2`` tokens with [CLS]/[SEP]."""
    return " ".join(["river"] * n)


def test_brpop_fetch_takes_the_tenant_lists_in_priority_order_and_leaves_nothing(
    bstack: Any,
) -> None:
    r = redis.Redis.from_url(bstack.s.redis_url())
    client = FleetClient(bstack.s)
    try:
        # the worker is up and fetching (its first request answered)
        assert client.submit("text", {"text": "warm"}, "bulk").get(60)["dim"] == 384
        r.config_resetstat()
        owners = [*TENANTS, None]
        backlog = [
            SubmitRequest("text", {"text": words(1 + i % 12)}, "bulk", tenant=owners[i % 3])
            for i in range(450)
        ]
        bulk = client.submit_many(backlog)
        # the backlog waits in each tenant's list and the shared one
        tenant_lists = [k for k in r.keys("text*") if b"\x1f" in k]
        assert {k.rsplit(b"\x1f", 1)[1] for k in tenant_lists} == {b"acme", b"other"}
        realtime = [
            client.submit("text", {"text": words(13 + i)}, "realtime", tenant=owners[i % 3])
            for i in range(3)
        ]
        rt_done = client.wait_all(realtime, timeout_s=60)
        bulk_done = client.wait_all(bulk, timeout_s=180)
        for out in [*bulk_done, *rt_done]:
            assert out is not None and "result" in out, out
        # each answer is its own request's: its token count is its text's
        for req, out in zip(backlog, bulk_done, strict=True):
            assert out["result"]["tokens"] == len(req.inputs["text"].split()) + 2
        for i, out in enumerate(rt_done):
            assert out["result"]["tokens"] == 13 + i + 2
        # REALTIME does not wait for the BULK backlog ahead of it
        last_rt = max(o["done_ms"] for o in rt_done)
        finished_before = sum(1 for o in bulk_done if o["done_ms"] <= last_rt)
        assert finished_before < len(bulk) // 2, finished_before
        # the worker fetched with BRPOP (no keyspace subscription), naming the tenant lists
        stats = r.info("commandstats")
        assert stats.get("cmdstat_brpop", {}).get("calls", 0) > 0, stats
        assert r.pubsub_channels("__keyspace@*") == []
        # nothing lost or left behind: every list empty, nothing unacked, acme's set empty
        deadline = time.monotonic() + 30
        while r.hlen(schema.UNACKED_KEY) or r.scard(open_key("acme")):
            assert time.monotonic() < deadline, "unacked or acme's open set not emptied"
            time.sleep(0.05)
        left = {k: r.llen(k) for k in r.keys("text*") if r.type(k) == b"list"}
        assert all(n == 0 for n in left.values()), left
        # with only tenant lists holding messages, the BRPOP itself must name them (the
        # take after a BRPOP reads them too, but only once some BRPOP has answered)
        alone = [
            client.submit("text", {"text": words(3)}, "bulk", tenant="acme"),
            client.submit("text", {"text": words(4)}, "realtime", tenant="other"),
        ]
        outs = client.wait_all(alone, timeout_s=30)
        assert [o and o["result"]["tokens"] for o in outs] == [5, 6], outs
    finally:
        client.close()
