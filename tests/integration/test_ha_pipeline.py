"""``FleetClient.submit_many`` behind Sentinel (a local primary, replica and three sentinels,
``producer.stack.sentinel``; no workers): each pipelined chunk is followed by ``WAIT`` on its
connection, so the chunk is on the replica when the call returns, as kombu's publish is
(``shared.ha``); without a replica a chunk stands on the primary and the waiter backs off.
The gateway's push and ``AsyncFleetClient``'s (made from a ``sentinel://`` URL) too.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

import pytest
import redis

from producer.client import AsyncFleetClient, Event, FleetClient, SubmitRequest
from producer.client.fleet import CHUNK
from producer.stack.local import Stack
from producer.stack.sentinel import node_port, start_node
from producer.tools.chaos.ha import _ports
from shared import schema
from shared.redis_client import node_client
from tests.conftest import own_redis

pytestmark = pytest.mark.integration

BULK_LIST = schema.priority_list_key("text", 9)


@pytest.fixture(scope="module")
def ha_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    port, sentinels = _ports()
    overrides = {
        "FLEET_REDIS__PORT": str(port),
        "FLEET_REDIS__SENTINELS": json.dumps([f"127.0.0.1:{p}" for p in sentinels]),
        "FLEET_REDIS__SENTINEL_DOWN_AFTER_MS": "5000",  # no failover while the replica is off
    }
    with own_redis(tmp_path_factory, "ha-pipe", overrides) as st:
        yield st


def node(st: Stack, name: str) -> redis.Redis:
    return node_client(st.s, st.s.redis.host, node_port(st, name), socket_timeout=5)


def waits(st: Stack) -> int:
    """``WAIT`` commands the primary has run."""
    return int(node(st, "redis").info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def wait_for_replica(primary: redis.Redis, timeout_s: float = 30.0) -> None:
    """Until the replica is attached and has acknowledged everything the primary wrote (a
    replica just restarted answers ``WAIT`` short while it syncs)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = primary.info("replication")
        replica = info.get("slave0") or {}
        if replica.get("state") == "online" and replica.get("offset", 0) >= int(
            info["master_repl_offset"]
        ):
            return
        assert time.monotonic() < deadline, f"the replica did not catch up: {info}"
        time.sleep(0.2)


def texts(n: int, start: int = 0) -> list[SubmitRequest]:
    return [SubmitRequest("text", {"text": f"words {start + i}"}, "bulk") for i in range(n)]


def test_each_chunk_is_on_the_replica_when_submit_many_returns(ha_stack: Stack) -> None:
    client = FleetClient(ha_stack.s)
    primary, replica = node(ha_stack, "redis"), node(ha_stack, "redis-replica")
    try:
        client.submit_many(texts(1))  # connected (the pool's first connection) before counting
        before = waits(ha_stack)
        handles = client.submit_many(texts(2 * CHUNK + 1))  # three chunks
        assert replica.llen(BULK_LIST) == primary.llen(BULK_LIST) == 2 * CHUNK + 2
        assert waits(ha_stack) - before == 3
        ids = {json.loads(m)["headers"]["id"] for m in replica.lrange(BULK_LIST, 0, -1)}
        assert {h.id for h in handles} <= ids
    finally:
        primary.delete(BULK_LIST)
        client.close()


def test_without_a_replica_a_chunk_stands_and_the_waiter_backs_off(ha_stack: Stack) -> None:
    client = FleetClient(ha_stack.s)
    primary = node(ha_stack, "redis")
    ha_stack.stop("redis-replica")
    try:
        t0 = time.monotonic()
        client.submit_many(texts(10))  # WAIT answers short after its timeout: still primary
        short_s = time.monotonic() - t0
        before = waits(ha_stack)
        t0 = time.monotonic()
        client.submit_many(texts(10, 10))  # within the backoff: no WAIT, a sentinel check
        assert waits(ha_stack) == before
        assert time.monotonic() - t0 < short_s
        assert short_s >= ha_stack.s.redis.wait_timeout_ms / 1000.0
        assert primary.llen(BULK_LIST) == 20
    finally:
        primary.delete(BULK_LIST)
        client.close()
        start_node(ha_stack, "redis-replica")


def test_the_gateways_push_is_on_the_replica_when_it_returns(ha_stack: Stack) -> None:
    """The HTTP gateway's enqueue behind Sentinel: ``WAIT`` on the transaction's connection
    (it pushed with ``redis.asyncio`` and no ``WAIT`` before, so a failover could lose it);
    the job's record travels in the same transaction."""
    from producer.gateway.commit import Attempt
    from producer.gateway.jobs import JobService
    from producer.gateway.models import model_specs

    client = FleetClient(ha_stack.s)
    primary, replica = node(ha_stack, "redis"), node(ha_stack, "redis-replica")

    async def admitted() -> None:
        return None

    async def push(task_id: str) -> bytes | None:
        gateway = AsyncFleetClient(ha_stack.s)  # as the gateway makes its client
        jobs = JobService(gateway, model_specs(ha_stack.s))
        try:
            env = gateway.envelope("text", {"text": "through the gateway"}, "bulk", None)
            message = gateway.message(env, task_id)
            attempt = Attempt(task_id, schema.job_key(task_id), '{"id": 1}', 60, message)
            return await jobs._create(attempt, admitted)
        finally:
            jobs.pool.shutdown(wait=True)
            await gateway.aclose()

    wait_for_replica(primary)  # another test may have restarted it
    warm: list[str] = []
    try:
        # until a push waits: a short WAIT earlier in this process (another test's, without
        # a replica) pauses waiting for the waiter's backoff
        deadline = time.monotonic() + 10
        while True:
            before = waits(ha_stack)
            asyncio.run(push(f"gw-warm-{len(warm)}"))
            warm.append(f"gw-warm-{len(warm)}")
            if waits(ha_stack) > before:
                break
            assert time.monotonic() < deadline, "no push waited for the replica"
            time.sleep(0.3)
        before = waits(ha_stack)
        asyncio.run(push("gw-1"))
        assert waits(ha_stack) - before == 1
        on_replica = [json.loads(m)["headers"]["id"] for m in replica.lrange(BULK_LIST, 0, -1)]
        assert on_replica == ["gw-1", *reversed(warm)]  # newest first
        assert replica.get(schema.job_key("gw-1")) == b'{"id": 1}'
        assert asyncio.run(push("gw-1")) == b'{"id": 1}'  # the same id again: nothing sent
        assert primary.llen(BULK_LIST) == len(warm) + 1
    finally:
        primary.delete(BULK_LIST, *(schema.job_key(i) for i in ["gw-1", *warm]))
        client.close()


def test_the_async_client_from_a_sentinel_url_alone_waits_for_the_replica(
    ha_stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AsyncFleetClient`` made from a ``sentinel://`` URL, no ``FLEET_*`` variable (the
    master's name and the sentinels' password in its query): its submissions are on the
    replica when they return (the blocking path's ``WAIT``, on a thread), and a cancel
    reaches a waiter on the primary the sentinels name."""
    s = ha_stack.s
    query = {"master_name": s.redis.master_name, "sentinel_password": s.sentinel_password()}
    url = f"{s.redis_url('producer')}?{urlencode(query)}"
    primary, replica = node(ha_stack, "redis"), node(ha_stack, "redis-replica")
    for name in list(os.environ):
        if name.upper().startswith("FLEET_"):
            monkeypatch.delenv(name)

    async def run() -> tuple[int, int, int, list[Event]]:
        async with AsyncFleetClient.from_url(url) as aio:
            assert aio.settings.ha and aio.settings.redis.sentinels == s.redis.sentinels
            deadline = time.monotonic() + 10
            while True:  # until a submission waits (a short WAIT earlier backs the waiter off)
                before = waits(ha_stack)
                await aio.submit_many(texts(1))
                if waits(ha_stack) > before:
                    break
                assert time.monotonic() < deadline, "no submission waited for the replica"
                await asyncio.sleep(0.3)
            before = waits(ha_stack)
            handles = await aio.submit_many(texts(2 * CHUNK + 1))  # three chunks
            waited, lengths = waits(ha_stack) - before, replica.llen(BULK_LIST)
            follow = asyncio.create_task(_events(handles[0].events(timeout_s=30)))
            await asyncio.sleep(0.3)  # subscribed
            assert await aio.cancel(handles[0].id) is True
            return waited, lengths, primary.llen(BULK_LIST), await follow

    wait_for_replica(primary)
    try:
        waited, on_replica, on_primary, seen = asyncio.run(run())
        assert waited == 3 and on_replica == on_primary
        assert [e.state for e in seen] == ["REVOKED"]
    finally:
        primary.delete(BULK_LIST)


async def _events(events: Any) -> list[Event]:
    return [e async for e in events]
