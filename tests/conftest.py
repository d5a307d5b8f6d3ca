"""Shared fixtures: a real Redis, real Celery workers and Flower, on free loopback ports.

The integration stack is started once per session through the product's own
:class:`producer.stack.local.Stack` (so ``fleet up``/``fleet down`` are exercised too), in a
temporary run directory, with its own ports: a developer's ``make up`` stack is untouched.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from producer.stack.local import free_port
from shared.procs import running

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "data"

# Traced encoders cached for this session (workers/models/trace_cache.py): the first text
# worker traces and stores, later test stacks load. Tests that start processes without the
# FLEET_* environment (the bench smoke, the README's blocks) use the user's cache instead.
_TRACE_CACHE = tempfile.mkdtemp(prefix="mmfleet-trace-cache-")
os.environ.setdefault("FLEET_TRACE_CACHE_DIR", _TRACE_CACHE)
atexit.register(shutil.rmtree, _TRACE_CACHE, True)


def free_port_block(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports (worker metrics use base + i)."""
    for _ in range(50):
        base = free_port()  # producer.stack.local's
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports")


@pytest.fixture()
def no_fleet_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A test without FLEET_* variables (a shell or a session fixture may set them)."""
    for name in list(os.environ):
        if name.upper().startswith("FLEET_"):
            monkeypatch.delenv(name)
    yield


@pytest.fixture(scope="session")
def fleet_settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """Settings of the test stack; its FLEET_* variables are exported for subprocesses."""
    from producer.stack.local import isolated_environment

    # A /dev/shm root of the session's own, removed at the end: the default root
    # (/dev/shm/mmfleet-<uid>) belongs to a developer's own stack and outlived test runs.
    shm_root = Path(f"/dev/shm/mmfleet-{os.getuid()}-tests-{os.getpid()}")
    overrides = {
        "FLEET_CONFIG": str(REPO / "configs" / "fleet.toml"),
        "FLEET_TRANSPORT__SHM_ROOT": str(shm_root),
        "FLEET_METRICS__PORT_BASE": str(free_port_block(4)),  # the metrics test scrapes them
        # Smaller batches keep the workers' warmup short; batching is still exercised.
        "FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE": "16",
        "FLEET_MODALITIES__IMAGE__BATCHING__MAX_BATCH_SIZE": "4",
    }
    try:
        with isolated_environment(tmp_path_factory.mktemp("fleet-run"), overrides) as settings:
            yield settings
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)


@pytest.fixture(scope="session")
def stack(fleet_settings: object) -> Iterator[object]:
    """Redis + text worker + image worker + Flower, up for the whole session."""
    from producer.stack.local import Stack

    st = Stack(fleet_settings)  # type: ignore[arg-type]
    st.up(["text", "image"], flower=True)
    yield st
    # Every fleet process ran as its ACL user (shared.acl) all session: none was refused a
    # command (tests that provoke refusals on purpose reset the log after them).
    import redis

    admin = redis.Redis.from_url(st.s.redis_url("admin"), socket_timeout=5)
    entries = admin.acl_log(count=50)
    pids = {name: st._read_pid(st.pids / f"{name}.pid") for name in st.status()}
    st.down()
    left = [n for n, pid in pids.items() if pid is not None and running(pid)]
    assert not left, f"processes left running after down(): {left}"
    denied, foreign = refused_by_acl(entries)
    if foreign:  # not a fleet process: said, not failed (see refused_by_acl)
        print(f"failed logins as Redis' default user on the session stack: {foreign}")
    assert denied == [], f"Redis refused fleet processes' commands (ACL LOG): {denied}"


def refused_by_acl(entries: list[dict[str, Any]]) -> tuple[list[Any], list[Any]]:
    """ACL LOG entries split into what a fleet process was refused (a command, key or
    channel its user may not touch, or a failed login as one of the fleet's users) and
    failed logins as ``default``. Every fleet process logs in as its own user except
    admin tooling, which holds the right password; a failed ``default`` login is a process
    of another test stack (these tests run in two processes on one machine, each stack on
    a free port: a probe of a port another process's stack used) and says nothing about
    least privilege."""
    denied, foreign = [], []
    for e in entries:
        default_login = e.get("reason") == "auth" and e.get("username") == "default"
        (foreign if default_login else denied).append(e)
    return denied, foreign


@pytest.fixture(scope="session")
def client(stack: object, fleet_settings: object) -> Iterator[object]:
    from producer.client import FleetClient

    c = FleetClient(fleet_settings)  # type: ignore[arg-type]
    yield c
    c.close()  # gives back the released files it kept for reuse


_OPS: dict[int, Any] = {}


def ops_app(settings: Any) -> Any:
    """An operator's Celery app on ``settings``' stack (cached): control broadcasts (ping,
    stats, cancel/add consumer) and raw reads of fleet internals are the operator's, not the
    producer's (shared.acl)."""
    from shared.celery_app import make_app

    key = id(settings)
    if key not in _OPS:
        _OPS[key] = make_app(settings, name="test-operator", role="operator")
    return _OPS[key]


@contextlib.contextmanager
def own_text_stack(
    tmp_path_factory: pytest.TempPathFactory, name: str, overrides: dict[str, str]
) -> Iterator[Any]:
    """Redis + one text worker of a test module's own (``overrides``: its FLEET_* values),
    so that faults injected there cannot disturb the session stack."""
    from producer.stack.local import Stack, isolated_environment

    with isolated_environment(tmp_path_factory.mktemp(name), overrides) as settings:
        st = Stack(settings)
        st.up(["text"], flower=False)
        try:
            yield st
        finally:
            st.down()


@contextlib.contextmanager
def own_redis(
    tmp_path_factory: pytest.TempPathFactory, name: str, overrides: dict[str, str] | None = None
) -> Iterator[Any]:
    """A Redis of a test module's own (no worker, Flower or gateway): its keys, scripts and
    command counts are that module's alone."""
    from producer.stack.local import Stack, isolated_environment

    with isolated_environment(tmp_path_factory.mktemp(name), overrides or {}) as settings:
        st = Stack(settings)
        st.up([], flower=False, gateway=False)
        try:
            yield st
        finally:
            st.down()
