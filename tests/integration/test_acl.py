"""Least privilege on Redis (shared.acl): every fleet process connects as the ACL user of its
role; a producer can enqueue and read results and nothing else; no secret on a command line.

Runs against the session stack (real Redis, text and image workers, Flower).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
import redis

from producer.client import FleetClient, image_inputs
from shared import schema
from shared.acl import ADMIN, ROLES

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
IMAGES = HERE.parent.parent / "data" / "images"


def _as(settings: Any, role: str) -> redis.Redis:
    return redis.Redis.from_url(settings.redis_url(role), socket_timeout=5)


def _denied(r: redis.Redis, *cmd: Any) -> bool:
    try:
        r.execute_command(*cmd)
    except redis.exceptions.NoPermissionError:
        return True
    return False


def test_every_fleet_process_connects_as_its_role(stack: Any, client: FleetClient) -> None:
    client.submit("text", {"text": "which user am I"}).get(30)
    admin = _as(stack.s, ADMIN)
    users = {c["user"] for c in admin.client_list()}
    # workers (kombu, results, leases), the producer (this client), Flower (operator)
    assert {"worker", "producer", "operator"} <= users
    assert not (users - {"worker", "producer", "operator", "default"})


def test_the_producer_cannot_administer_script_or_read_fleet_internals(stack: Any) -> None:
    p = _as(stack.s, "producer")
    assert p.ping()
    assert p.info()["redis_version"]  # ioredis' ready check (celery-node): statistics only
    for cmd in (
        ("CONFIG", "GET", "maxmemory"),
        ("CONFIG", "SET", "maxmemory", "1"),
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("SHUTDOWN", "NOSAVE"),
        ("EVAL", "return 1", "0"),
        ("KEYS", "*"),
        ("DEBUG", "SLEEP", "0"),
        ("ACL", "LIST"),
        ("CLIENT", "LIST"),  # other clients' addresses, names and last commands
        ("SLOWLOG", "GET"),  # other clients' commands with their arguments
        ("HGETALL", schema.UNACKED_KEY),  # other requests' payloads
        ("DEL", schema.UNACKED_INDEX_KEY),
        ("GET", schema.blame_record_key("host:1:ab", "decode")),  # what workers run
        ("SMEMBERS", schema.BLAME_INDEX_KEY),
        ("SUBSCRIBE", "__keyspace@0__:text"),
        ("PUBLISH", "/0.celery.pidbox", "{}"),  # control broadcasts (shutdown) are not its
    ):
        assert _denied(p, *cmd), cmd
    admin = _as(stack.s, ADMIN)
    assert admin.ping()  # Redis survived the attempts
    admin.execute_command("ACL", "LOG", "RESET")  # these denials were on purpose


def test_workers_and_operators_cannot_reconfigure_or_wipe_redis(stack: Any) -> None:
    for role in ("worker", "operator"):
        r = _as(stack.s, role)
        for cmd in (("CONFIG", "SET", "maxmemory", "1"), ("FLUSHALL",), ("SHUTDOWN", "NOSAVE")):
            assert _denied(r, *cmd), (role, cmd)
    _as(stack.s, ADMIN).execute_command("ACL", "LOG", "RESET")


def test_a_worker_keeps_its_blame_records(stack: Any) -> None:
    """Poison accounting's records (``workers.batching.admission.InFlight``): a worker sets,
    reads and indexes them, and runs the scripts that do."""
    w = _as(stack.s, "worker")
    key = schema.blame_record_key("acl-test:1:ab", "lane-1")
    assert w.set(key, "a b", ex=60)
    assert w.get(key) == b"a b"
    w.sadd(schema.BLAME_INDEX_KEY, key)
    assert key.encode() in w.smembers(schema.BLAME_INDEX_KEY)
    assert w.srem(schema.BLAME_INDEX_KEY, key) == 1
    assert w.delete(key) == 1
    assert w.eval("return redis.call('SMEMBERS', KEYS[1])", 1, schema.BLAME_INDEX_KEY) is not None


def test_the_exporter_reads_queue_stats_as_operator_and_a_producer_cannot(stack: Any) -> None:
    """``fleet exporter``'s script (priority lists and every queue's unacked entries) runs
    under the operator's rules; the producer, whose rules keep other requests' payloads
    from it, is refused."""
    from producer.ops.exporter import all_queues
    from shared.queue_stats import QueueReader

    admin = _as(stack.s, ADMIN)
    admin.execute_command("ACL", "LOG", "RESET")
    stats, _ = QueueReader(_as(stack.s, "operator"), all_queues()).read()
    assert [st.queue for st in stats] == all_queues()
    assert admin.execute_command("ACL", "LOG", "10") == []
    with pytest.raises(redis.exceptions.NoPermissionError):
        QueueReader(_as(stack.s, "producer"), all_queues()).read()
    admin.execute_command("ACL", "LOG", "RESET")  # that denial was on purpose


def test_a_producer_does_its_whole_job_without_one_denied_command(
    stack: Any, client: FleetClient
) -> None:
    """Text and image requests, a batch, a queue-depth and liveness read, a worker ping and
    Flower's task list: Redis's ACL log stays empty (a denial kombu or redis-py swallows,
    such as CLIENT SETINFO, would show there)."""
    admin = _as(stack.s, ADMIN)
    admin.execute_command("ACL", "LOG", "RESET")
    fresh = FleetClient(stack.s)
    try:
        handles = [fresh.submit("text", {"text": f"acl {i}"}, "normal") for i in range(5)]
        handles.append(fresh.submit("image", image_inputs(next(IMAGES.glob("*.jpg"))), "high"))
        assert all(h.outcome(60).get("result") for h in handles)
        assert set(fresh.queue_depth("text")) == {"realtime", "high", "normal", "bulk"}
        assert fresh.live_workers("text") and fresh.live_workers("image")
        assert fresh.live_workers("video") == []
    finally:
        fresh.close()
    assert stack.flower_ok()
    log = admin.execute_command("ACL", "LOG", "50")
    assert log == [], log


def test_no_secret_on_any_command_line_and_secret_files_are_private(stack: Any) -> None:
    s = stack.s
    secrets = [s.redis_password_file(r).read_text().strip() for r in (ADMIN, *ROLES)]
    secrets.append(s.flower_password())
    pids = [stack._read_pid(p) for p in stack.pids.glob("*.pid")]
    assert len(pids) >= 4  # redis, two workers, flower
    for pid in pids:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        for secret in secrets:
            assert secret not in argv, pid
    conf = (s.run_dir / "redis.conf").read_text()
    assert not any(secret in conf for secret in secrets)  # hashes only
    for role in (ADMIN, *ROLES):
        mode = stat.S_IMODE(os.stat(s.redis_password_file(role)).st_mode)
        assert mode == 0o600, role
    assert stat.S_IMODE(os.stat(s.run_dir / "redis.conf").st_mode) == 0o600
