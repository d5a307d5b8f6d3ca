"""A tenant's ``max_queued`` (``shared.tenant_quota``) on a real Redis and text worker of its
own: refusals coded ``TENANT_QUOTA`` at the blocking and asyncio clients, ``fleet submit``
(exit 1, as ``QUEUE_FULL``) and the gateway (429 with ``Retry-After``; a token bound to a
tenant cannot name another: 403), other tenants and the default one untouched, and the count
exact through faults: a worker SIGKILLed with the tenant's requests in its window
(redelivered by the lease), a duplicate delivery, a cancel and a deadline that passes in the
queue. Every request's final state is counted, and the tenant's count is back to 0 at the
end.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis

from producer.client import AsyncFleetClient, FleetClient, SubmitRequest
from producer.client.results import ResultHandle
from shared import schema
from shared.errors import TenantQuota
from shared.tenant_quota import open_key
from tests.conftest import REPO, own_text_stack

pytestmark = pytest.mark.integration

LEASE_S = 3.0
LIMIT = 40
ACME_TOKEN = "acme-token-0123456789abcdef"


@pytest.fixture(scope="module")
def qstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    overrides = {
        "FLEET_CONFIG": str(REPO / "configs" / "fleet.toml"),
        "FLEET_REDIS__LEASE_S": str(LEASE_S),
        "FLEET_DEBUG__FAULT_INJECTION": "true",
        "FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE": "8",
        "FLEET_MODALITIES__TEXT__BATCHING__LENGTH_BUCKETS": "[16]",
        "FLEET_METRICS__PORT_BASE": "0",
        "FLEET_TENANTS__ACME__MAX_QUEUED": str(LIMIT),
        "FLEET_TENANTS__OTHER__WEIGHT": "2",
        "FLEET_TENANTS__ACME__GATEWAY_TOKEN": ACME_TOKEN,
    }
    with own_text_stack(tmp_path_factory, "tenant-quota", overrides) as st:
        yield st


@pytest.fixture(scope="module")
def qclient(qstack: Any) -> Iterator[FleetClient]:
    c = FleetClient(qstack.s)
    yield c
    c.close()


@pytest.fixture()
def worker(qstack: Any) -> Iterator[Any]:
    if not qstack.alive("worker-text"):
        qstack.start_worker("text")
    yield qstack
    if not qstack.alive("worker-text"):
        qstack.stop("worker-text", timeout_s=1)
        qstack.start_worker("text")


def redis_of(st: Any) -> redis.Redis:
    return redis.Redis.from_url(st.s.redis_url())


def held(st: Any) -> int:
    return int(redis_of(st).scard(open_key("acme")))


def words(i: int) -> str:
    return f"Sentence number {i} about a quiet river."


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def slow_blocker(client: FleetClient, seconds: float) -> Any:
    """A request of no tenant that holds the worker's main lane for ``seconds``."""
    h = client.submit("text", {"text": "blocker", "_inject": f"slow:{seconds}"}, "bulk")
    time.sleep(0.5)  # taken and running before what follows
    return h


def test_max_queued_refuses_at_the_client_and_counts_back_to_zero(
    qclient: FleetClient, worker: Any
) -> None:
    blocker = slow_blocker(qclient, 3)
    first = qclient.submit_many(
        [SubmitRequest("text", {"text": words(i)}, "bulk", tenant="acme") for i in range(LIMIT)]
    )
    assert held(worker) == LIMIT
    with pytest.raises(TenantQuota) as refused:
        qclient.submit("text", {"text": "one too many"}, "bulk", tenant="acme")
    assert refused.value.code == "TENANT_QUOTA" and "acme" in str(refused.value)
    # other tenants, and requests without one, are not limited by acme's quota
    others = [
        qclient.submit("text", {"text": "other"}, "bulk", tenant="other"),
        qclient.submit("text", {"text": "nobody"}, "bulk"),
    ]
    outs = qclient.wait_all([blocker, *first, *others], timeout_s=120)
    assert all(o is not None and "result" in o for o in outs), outs
    wait_for(lambda: held(worker) == 0, "acme's count to reach 0")
    # room again
    assert qclient.submit("text", {"text": "fits again"}, tenant="acme").get(60)["dim"] == 384
    wait_for(lambda: held(worker) == 0, "acme's count to reach 0")


def test_the_asyncio_client_refuses_the_same_way(qclient: FleetClient, worker: Any) -> None:
    blocker = slow_blocker(qclient, 3)

    async def run() -> list[Any]:
        async with AsyncFleetClient(worker.s) as ac:
            handles = await ac.submit_many(
                [
                    SubmitRequest("text", {"text": words(i)}, "bulk", tenant="acme")
                    for i in range(LIMIT)
                ]
            )
            with pytest.raises(TenantQuota):
                await ac.submit("text", {"text": "one too many"}, "bulk", tenant="acme")
            return [ResultHandle(qclient, h.id, h.envelope) for h in handles]

    handles = asyncio.run(run())
    assert held(worker) == LIMIT
    outs = qclient.wait_all([blocker, *handles], timeout_s=120)
    assert all(o is not None and "result" in o for o in outs), outs
    wait_for(lambda: held(worker) == 0, "acme's count to reach 0")


def test_the_count_stays_exact_through_a_sigkill_a_duplicate_a_cancel_and_an_expiry(
    qclient: FleetClient, worker: Any
) -> None:
    r = redis_of(worker)
    blocker = slow_blocker(qclient, 4)
    reqs = [SubmitRequest("text", {"text": words(i)}, "bulk", tenant="acme") for i in range(30)]
    reqs.append(SubmitRequest("text", {"text": "expires"}, "bulk", timeout_s=1.5, tenant="acme"))
    handles = qclient.submit_many(reqs)
    cancelled = handles[5]
    assert qclient.cancel(cancelled.id)  # its slot released at once
    # a second copy of one request (a duplicate delivery)
    dup = handles[7]
    with qclient.app.producer_or_acquire() as producer:
        env = dup.envelope
        qclient.publish(producer, env, dup.id, schema.queue_for(env.modality, env.priority), 9)
    assert held(worker) == len(reqs) - 1
    wait_for(lambda: r.hlen(schema.UNACKED_KEY) >= 20, "the worker to take the tenant's requests")
    pid = worker._read_pid(worker.pids / "worker-text.pid")
    os.killpg(pid, signal.SIGKILL)
    worker.stop("worker-text", timeout_s=1)
    before = held(worker)  # the blocker still ran: the tenant's requests are all held
    assert before >= len(reqs) - 2  # at most the cancelled and the expired one settled
    time.sleep(LEASE_S)
    assert held(worker) == before  # nothing released by a worker that died
    worker.start_worker("text")
    outs = qclient.wait_all([blocker, *handles], timeout_s=LEASE_S + 90)
    states: dict[str, int] = {}
    for o in outs[1:]:
        assert o is not None
        code = o["error"]["code"] if "error" in o else "SUCCESS"
        states[code] = states.get(code, 0) + 1
    print("final states:", states)
    assert states == {"SUCCESS": len(reqs) - 2, "REVOKED": 1, "DEADLINE_EXCEEDED": 1}
    # every message drained (the cancelled one and the duplicate too): the count is 0
    wait_for(lambda: held(worker) == 0, "acme's count to reach 0", timeout_s=LEASE_S + 30)
    wait_for(lambda: r.hlen(schema.UNACKED_KEY) == 0, "the unacked hash to empty")


def test_a_cancel_releases_the_tenants_room_at_once(qclient: FleetClient, worker: Any) -> None:
    blocker = slow_blocker(qclient, 3)  # the tenant's requests wait behind it, unrun
    handles = fill_acme(qclient)
    with pytest.raises(TenantQuota):
        qclient.submit("text", {"text": "one too many"}, "bulk", tenant="acme")
    assert qclient.cancel(handles[0].id)
    assert held(worker) == LIMIT - 1  # released by the cancel, its message still queued
    assert not qclient.cancel(handles[0].id)  # final already: releases nothing more
    extra = qclient.submit("text", {"text": "fits after a cancel"}, "bulk", tenant="acme")

    async def cancel_one() -> bool:
        async with AsyncFleetClient(worker.s) as ac:
            return await ac.cancel(handles[1].id)

    assert asyncio.run(cancel_one())
    assert held(worker) == LIMIT - 1
    outs = qclient.wait_all([blocker, *handles, extra], timeout_s=120)
    codes = [o["error"]["code"] if "error" in o else "SUCCESS" for o in outs if o is not None]
    assert codes == ["SUCCESS", "REVOKED", "REVOKED", *["SUCCESS"] * (LIMIT - 1)], codes
    # the worker drained the cancelled messages: its SREM removed nothing more
    wait_for(lambda: held(worker) == 0, "acme's count to reach 0")


def infer(text: str, **params: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]
    }
    if params:
        body["parameters"] = params
    return body


def fill_acme(client: FleetClient) -> list[Any]:
    return client.submit_many(
        [SubmitRequest("text", {"text": words(i)}, "bulk", tenant="acme") for i in range(LIMIT)]
    )


def test_the_cli_and_the_gateway_refuse_a_full_tenant(qclient: FleetClient, worker: Any) -> None:
    blocker = slow_blocker(qclient, 6)
    first = fill_acme(qclient)
    env = {**os.environ, **worker.env()}
    cli = subprocess.run(
        [sys.executable, "-m", "producer.cli", "submit", "text", "--text", "more", "--tenant",
         "acme", "--wait-s", "0"],
        capture_output=True, text=True, env=env, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert cli.returncode == 1, cli.stderr
    assert json.loads(cli.stdout)["error"]["code"] == "TENANT_QUOTA"
    worker.start_gateway()
    try:
        g = worker.s.gateway
        url = f"http://{g.host}:{g.port}"
        main = {"Authorization": f"Bearer {worker.s.gateway_token()}"}
        acme = {"Authorization": f"Bearer {ACME_TOKEN}"}
        infer_url = "/v2/models/minilm/infer"
        with httpx.Client(base_url=url, timeout=60.0) as h:
            async_ = {"Prefer": "respond-async"}
            r = h.post(infer_url, json=infer(words(1), tenant="acme"), headers=main)
            assert (r.status_code, r.json()["code"]) == (429, "TENANT_QUOTA"), r.text
            assert int(r.headers["Retry-After"]) >= 1
            r = h.post(infer_url, json=infer(words(2)), headers={**main, "X-Fleet-Tenant": "acme"})
            assert (r.status_code, r.json()["code"]) == (429, "TENANT_QUOTA"), r.text
            # the tenant's own token: its requests are acme's, whatever they name
            r = h.post(infer_url, json=infer(words(3)), headers=acme)
            assert (r.status_code, r.json()["code"]) == (429, "TENANT_QUOTA"), r.text
            r = h.post(infer_url, json=infer(words(4), tenant="other"), headers=acme)
            assert (r.status_code, r.json()["code"]) == (403, "TENANT_FORBIDDEN"), r.text
            r = h.post(infer_url, json=infer(words(5)), headers={**acme, "X-Fleet-Tenant": "other"})
            assert (r.status_code, r.json()["code"]) == (403, "TENANT_FORBIDDEN"), r.text
            # another tenant, with the gateway's token, is admitted
            r = h.post(infer_url, json=infer(words(6), tenant="other"), headers={**main, **async_})
            assert r.status_code == 202, r.text
            other_id = r.json()["id"]
            outs = qclient.wait_all([blocker, *first], timeout_s=120)
            assert all(o is not None and "result" in o for o in outs), outs
            wait_for(lambda: held(worker) == 0, "acme's count to reach 0")
            # room again: acme's token sends an acme request
            r = h.post(infer_url, json=infer(words(7)), headers=acme)
            assert r.status_code == 200, r.text
        assert qclient.wait_all([ResultHandle(qclient, other_id, first[0].envelope)], 60)[0]
        wait_for(lambda: held(worker) == 0, "acme's count to reach 0")
    finally:
        worker.stop("gateway", timeout_s=5)


def test_the_count_survives_a_redis_restart_from_its_aof(qclient: FleetClient, worker: Any) -> None:
    """Redis SIGKILLed with the tenant's requests queued and held, started again from its
    AOF: the sets come back with the lists (written in the same transactions), every request
    finishes once, and the count ends at 0."""
    blocker = slow_blocker(qclient, 6)
    handles = fill_acme(qclient)
    r = redis_of(worker)
    wait_for(lambda: r.hlen(schema.UNACKED_KEY) >= 10, "the worker to hold a window")
    pid = worker._read_pid(worker.pids / "redis.pid")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not worker.alive("redis"), "redis-server to die", 10)
    worker.start_redis()
    assert held(worker) == LIMIT  # the requests, as they were: none final yet
    outs = qclient.wait_all([blocker, *handles], timeout_s=120)
    assert all(o is not None and "result" in o for o in outs), outs
    wait_for(lambda: held(worker) == 0, "acme's count to reach 0", timeout_s=LEASE_S + 30)
