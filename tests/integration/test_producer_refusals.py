"""Redis refusing a producer's writes (out of memory, a full disk under its AOF, a read-only
replica, an ACL rule), made real on a Redis of this module's: ``FleetClient``, ``fleet
submit`` and the gateway each say ``BROKER_UNAVAILABLE`` with the reason, at once. Before,
``FleetClient.submit`` raised kombu's ``OperationalError`` (the class of an unreachable
broker) after 0.6 s, or 6 s on a new connection under ``MISCONF``, the CLI said "lost the
connection to Redis", and the gateway's 503 named no reason."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from producer.client import FleetClient
from producer.stack.local import Stack, free_port
from shared import schema
from shared.errors import BrokerUnavailable
from shared.redis_client import redis_client
from tests.conftest import own_redis

pytestmark = pytest.mark.integration
REASONS = ("OOM", "MISCONF", "READONLY", "NOPERM")
BOUND_S = 0.5  # a refusal is answered at once: no reconnect, no retry policy's sleeps
# what the CLI's first line says for each, and a word of its fix on the second
SAYS = {
    "OOM": ("out of memory", "maxmemory"),
    "MISCONF": ("cannot persist", "free space"),
    "READONLY": ("read-only replica", "primary"),
    "NOPERM": ("denies a command to user 'producer'", "fleet up"),
}


@pytest.fixture(scope="module")
def st(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A Redis and a gateway, no worker: a text worker's heartbeat is written by hand, so
    that the gateway takes text requests (they stay queued)."""
    with own_redis(tmp_path_factory, "producer-refusals") as stack:
        stack.start_gateway()
        yield stack


@contextlib.contextmanager
def refusing(st: Stack, reason: str) -> Iterator[None]:
    """Redis refuses the producer's writes with ``reason`` for the block."""
    admin = redis_client(st.s, "admin", socket_timeout=10)
    try:
        if reason == "MISCONF":
            from producer.tools.chaos.aof_tmpfs import AofOnTmpfs

            with AofOnTmpfs(admin) as aof:
                aof.fill()
                yield
                aof.free()
            return
        if reason == "OOM":
            admin.config_set("maxmemory", 1)  # noeviction: every write refused, reads served
            undo: Any = lambda: admin.config_set("maxmemory", 0)  # noqa: E731
        elif reason == "READONLY":
            admin.execute_command("REPLICAOF", "127.0.0.1", free_port())  # a primary not there
            undo = lambda: admin.execute_command("REPLICAOF", "NO", "ONE")  # noqa: E731
        else:
            user = st.s.redis_credentials("producer")[0]
            admin.execute_command("ACL", "SETUSER", user, "-lpush")
            undo = lambda: admin.execute_command("ACL", "SETUSER", user, "+lpush")  # noqa: E731
        try:
            yield
        finally:
            undo()
    finally:
        admin.close()


def submit_refused(client: FleetClient) -> tuple[BrokerUnavailable, float]:
    t0 = time.monotonic()
    with pytest.raises(BrokerUnavailable) as info:
        client.submit("text", {"text": "refused, I expect"}, "bulk")
    return info.value, time.monotonic() - t0


@pytest.mark.parametrize("reason", REASONS)
def test_a_refusal_is_coded_with_its_reason_at_once(st: Stack, reason: str) -> None:
    admin = redis_client(st.s, "admin")
    for key in (schema.live_key("text"), schema.live_key("text", "minilm")):  # as a worker
        admin.zadd(key, {"text@heartbeat-by-hand": time.time() + 3600})
    warm = FleetClient(st.s)
    warm.submit("text", {"text": "before"}, "bulk")  # its connection is up
    url = f"http://{st.s.gateway.host}:{st.s.gateway.port}/v2/models/minilm/infer"
    auth = {"Authorization": f"Bearer {st.s.gateway_token()}"}
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}
    try:
        with refusing(st, reason):
            cold = FleetClient(st.s)  # a new connection: MISCONF refuses its first PING too
            try:
                for client in (warm, cold):
                    err, took_s = submit_refused(client)
                    assert (err.code, err.reason) == ("BROKER_UNAVAILABLE", reason), err
                    assert err.to_dict()["reason"] == reason
                    assert took_s < BOUND_S, f"{reason}: refused after {took_s:.2f} s"
            finally:
                cold.close()

            done = subprocess.run(
                [sys.executable, "-m", "producer.cli", "submit", "text", "--text", "hi"],
                capture_output=True,
                text=True,
                env=st.env(),
                timeout=60,
            )
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 3, done.stderr
            assert len(lines) == 2 and "Traceback" not in done.stderr, done.stderr
            cause, fix = SAYS[reason]
            assert cause in lines[0] and fix in lines[1], lines

            r = httpx.post(url, json=body, headers={**auth, "Prefer": "respond-async"})
            assert r.status_code == 503, r.text
            assert int(r.headers["Retry-After"]) >= 1
            assert (r.json()["code"], r.json()["reason"]) == ("BROKER_UNAVAILABLE", reason)
        # and once Redis takes writes again, the same calls go through
        warm.submit("text", {"text": "after"}, "bulk")
        r = httpx.post(url, json=body, headers={**auth, "Prefer": "respond-async"})
        assert r.status_code == 202, r.text
    finally:
        warm.close()
        admin.close()


def test_submits_refused_once_redis_fills_up_are_coded_with_cause_and_fix(st: Stack) -> None:
    """A tiny ``maxmemory`` (noeviction): the first submits are queued, then Redis is full
    and every later one is refused. Each refusal, through ``submit``, ``publish`` (kombu's
    path, one message per call), the gateway and ``fleet submit``, is ``BROKER_UNAVAILABLE``
    with reason ``OOM``, the cause and the fix; never a raw kombu or redis-py error."""
    admin = redis_client(st.s, "admin", socket_timeout=10)
    for key in (schema.live_key("text"), schema.live_key("text", "minilm")):  # as a worker
        admin.zadd(key, {"text@heartbeat-by-hand": time.time() + 3600})
    client = FleetClient(st.s)
    url = f"http://{st.s.gateway.host}:{st.s.gateway.port}/v2/models/minilm/infer"
    auth = {"Authorization": f"Bearer {st.s.gateway_token()}"}
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}
    text = "A man is playing a guitar. " * 20
    try:
        client.submit("text", {"text": "warm"}, "bulk")
        admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) + 256 * 1024)
        queued, refused = 0, []
        with client.app.producer_or_acquire() as producer:
            for i in range(2000):
                try:
                    if i % 2:
                        client.submit("text", {"text": text}, "bulk")
                    else:
                        env = client.envelope("text", {"text": text}, "bulk")
                        client.publish(producer, env, f"pub-{i}", "text", 9)
                    queued += 1
                except BrokerUnavailable as exc:
                    refused.append(exc)
        assert queued > 0 and len(refused) > 1000, (queued, len(refused))
        for exc in refused:
            assert (exc.code, exc.reason) == ("BROKER_UNAVAILABLE", "OOM"), exc
            assert "out of memory" in exc.message and "raise Redis' maxmemory" in exc.message

        r = httpx.post(url, json=body, headers=auth)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, r.text
        assert (r.json()["code"], r.json()["reason"]) == ("BROKER_UNAVAILABLE", "OOM")
        assert "out of memory" in r.json()["error"] and "maxmemory" in r.json()["error"]

        done = subprocess.run(
            [sys.executable, "-m", "producer.cli", "submit", "text", "--text", "hi"],
            capture_output=True, text=True, env=st.env(), timeout=60,
        )  # fmt: skip
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr
        assert "out of memory" in lines[0] and "maxmemory" in lines[1], lines
    finally:
        admin.config_set("maxmemory", 0)
        for key in admin.scan_iter("text*"):  # the queued requests: no worker takes them
            admin.delete(key)
        client.close()
        admin.close()
