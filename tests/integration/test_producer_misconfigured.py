"""A producer pointed at the wrong place or with the wrong password, on a real Redis of this
module's and a real listener that is not Redis (a TCP server answering as an HTTP server
does, the gateway's port for one): ``FleetClient``, ``AsyncFleetClient`` and ``fleet
submit`` each say ``BROKER_UNAVAILABLE`` with the reason ``NOT_REDIS`` or ``AUTH`` and its
fix. Before, the address that is not Redis raised redis-py's raw ``InvalidResponse``; a
wrong password was ``UNREACHABLE`` ("check that Redis runs"), from ``FleetClient`` after
about 12 s of kombu's and redis-py's retries; and the CLI blamed ``FLEET_REDIS__PASSWORD``
when the password came from ``FLEET_REDIS_URL``."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from producer.client import FleetClient
from producer.client.asyncio_client import AsyncFleetClient
from producer.stack.local import Stack, free_port
from shared.errors import BrokerUnavailable
from tests.conftest import own_redis

pytestmark = pytest.mark.integration
GUARD_S = 5.0  # a refused login fails at once; kombu's retries took about 12 s
HTTP_400 = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@pytest.fixture(scope="module")
def st(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with own_redis(tmp_path_factory, "producer-misconfigured") as stack:
        yield stack


@pytest.fixture(scope="module")
def not_redis() -> Iterator[int]:
    """The port of a TCP server that answers whatever it is sent as an HTTP server does."""
    server = socket.create_server(("127.0.0.1", free_port()))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(65536)  # redis-py's AUTH or command
                    conn.sendall(HTTP_400)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()


def url_of(st: Stack, password: str, port: int | None = None) -> str:
    return f"redis://producer:{password}@127.0.0.1:{port or st.s.redis.port}/{st.s.redis.db}"


def sync_error(url: str) -> tuple[BrokerUnavailable, float]:
    client = FleetClient.from_url(url)
    try:
        t0 = time.monotonic()
        with pytest.raises(BrokerUnavailable) as info:
            client.submit("text", {"text": "hi"}, "bulk")
        return info.value, time.monotonic() - t0
    finally:
        client.close()


def async_errors(url: str) -> tuple[list[BrokerUnavailable], float]:
    async def main() -> tuple[list[BrokerUnavailable], float]:
        errors: list[BrokerUnavailable] = []
        async with AsyncFleetClient.from_url(url) as aio:
            t0 = time.monotonic()
            for call in (aio.submit("text", {"text": "hi"}), aio.live_workers("text")):
                try:
                    await call
                except BrokerUnavailable as exc:
                    errors.append(exc)
            return errors, time.monotonic() - t0

    return asyncio.run(main())


def fleet_submit(st: Stack, url: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in st.env().items() if not k.upper().startswith("FLEET_REDIS")}
    env["FLEET_REDIS_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", "submit", "text", "--text", "hi"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_an_address_that_is_not_redis_is_not_redis(st: Stack, not_redis: int) -> None:
    url = url_of(st, "pw", not_redis)
    err, took = sync_error(url)
    assert (err.code, err.reason) == ("BROKER_UNAVAILABLE", "NOT_REDIS"), err
    assert "is not Redis" in err.message and "check the port" in err.message, err.message
    errors, _ = async_errors(url)
    assert [(e.code, e.reason) for e in errors] == [("BROKER_UNAVAILABLE", "NOT_REDIS")] * 2
    assert "could not publish" in errors[0].message and "check the port" in errors[0].message
    done = fleet_submit(st, url)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 2 and "answers but is not Redis" in lines[0], lines
    assert "FLEET_REDIS_URL" in lines[1], lines
    print(f"not Redis: FleetClient.submit raised after {took:.2f} s")


def test_a_wrong_password_is_auth_at_once(st: Stack) -> None:
    url = url_of(st, "wrongpw")
    err, took = sync_error(url)
    assert (err.code, err.reason) == ("BROKER_UNAVAILABLE", "AUTH"), err
    assert "refused the credentials" in err.message and "FLEET_REDIS_URL" in err.message
    assert "runs and answers" not in err.message  # UNREACHABLE's fix
    assert took < GUARD_S, f"refused after {took:.2f} s: retried"
    errors, async_took = async_errors(url)
    assert [(e.code, e.reason) for e in errors] == [("BROKER_UNAVAILABLE", "AUTH")] * 2
    assert async_took < GUARD_S
    print(f"wrong password: FleetClient {took:.2f} s, AsyncFleetClient {async_took:.2f} s")
    # and the right one, on the same clients' path, goes through
    good = FleetClient.from_url(url_of(st, st.s.redis_credentials("producer")[1]))
    try:
        assert good.submit("text", {"text": "hi"}, "bulk").id
    finally:
        good.close()


def test_the_cli_names_the_variable_the_wrong_password_came_from(st: Stack) -> None:
    done = fleet_submit(st, url_of(st, "wrongpw"))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 3 and len(lines) == 2, done.stderr
    assert "authentication failed" in lines[0], lines
    assert "the password in FLEET_REDIS_URL does not match" in lines[1], lines
    assert "FLEET_REDIS__PASSWORD" not in done.stderr
