"""A quota'd push (``shared.tenant_quota``) through real connection faults, on a Redis of the
module's own (no worker: what is pushed stays in the lists): a proxy in front of Redis
(``tests.netfaults``) loses the reply of the transaction that pushes a limited tenant's chunk
(the ``EXEC`` ran: the retry must not push it again), or loses the transaction itself while
another producer fills the tenant's ``max_queued`` (the retry must check again under a fresh
``WATCH`` and refuse, not push bare). Counted in the tenant's list and its open set, for the
blocking and the asyncio client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from producer.client import AsyncFleetClient, FleetClient, SubmitRequest
from shared.errors import TenantQuota
from shared.tenant_quota import open_key
from tests.conftest import own_redis
from tests.netfaults import ReplyDropper, RequestDropper

pytestmark = pytest.mark.integration

LIMIT = 10
# the push transaction's SADD to acme's open set (the check only reads it)
MARKER = "SADD\r\n$22\r\nfleet:tenant:acme:open"


@pytest.fixture(scope="module")
def rstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    overrides = {"FLEET_METRICS__PORT_BASE": "0", "FLEET_TENANTS__ACME__MAX_QUEUED": str(LIMIT)}
    with own_redis(tmp_path_factory, "quota-faults", overrides) as st:
        yield st


@pytest.fixture()
def admin(rstack: Any) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(rstack.s.redis_url("admin"))
    r.flushdb()
    yield r
    r.flushdb()
    r.close()


def via(st: Any, port: int) -> Any:
    """``st``'s settings with Redis at ``port`` (the proxy)."""
    return st.s.model_copy(update={"redis": st.s.redis.model_copy(update={"port": port})})


def requests(n: int, tag: str) -> list[SubmitRequest]:
    return [SubmitRequest("text", {"text": f"{tag} {i}"}, "bulk", tenant="acme") for i in range(n)]


def counts(r: redis.Redis) -> tuple[int, int]:
    """Messages waiting in acme's lists (every priority step), and its open set's size."""
    queued = sum(r.llen(k) for k in r.scan_iter(match="text*") if b"\x1facme" in k)
    return queued, int(r.scard(open_key("acme")))


def submit(settings: Any, reqs: list[SubmitRequest], asynchronous: bool) -> list[Any]:
    if not asynchronous:
        client = FleetClient(settings)
        try:
            return client.submit_many(reqs)
        finally:
            client.close()

    async def run() -> list[Any]:
        async with AsyncFleetClient(settings) as ac:
            return await ac.submit_many(reqs)

    return asyncio.run(run())


@pytest.mark.parametrize("asynchronous", [False, True], ids=["blocking", "asyncio"])
def test_a_push_whose_reply_is_lost_is_not_pushed_again(
    rstack: Any, admin: redis.Redis, asynchronous: bool
) -> None:
    proxy = ReplyDropper(rstack.s.redis.port, MARKER)
    try:
        proxy.armed = True
        handles = submit(via(rstack, proxy.port), requests(4, "lost reply"), asynchronous)
        assert proxy.dropped == 1  # the EXEC ran; its reply never came back
    finally:
        proxy.close()
    assert len(handles) == 4
    # each request once: the retry found its ids in the set and sent nothing more
    assert counts(admin) == (4, 4)
    assert admin.smembers(open_key("acme")) == {h.id.encode() for h in handles}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["blocking", "asyncio"])
def test_a_retried_push_checks_the_quota_again_under_a_fresh_watch(
    rstack: Any, admin: redis.Redis, asynchronous: bool
) -> None:
    direct = FleetClient(rstack.s)
    direct.submit_many(requests(LIMIT - 4, "before"))

    def racing_producer() -> None:  # while the first push is on its way: the rest of the room
        direct.submit_many(requests(4, "racing"))

    proxy = RequestDropper(rstack.s.redis.port, MARKER, racing_producer)
    try:
        proxy.armed = True
        with pytest.raises(TenantQuota):  # checked again after the reconnect: no room now
            submit(via(rstack, proxy.port), requests(3, "lost request"), asynchronous)
        assert proxy.dropped == 1
    finally:
        proxy.close()
        direct.close()
    assert counts(admin) == (LIMIT, LIMIT)  # max_queued held: nothing of the refused chunk
