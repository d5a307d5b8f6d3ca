"""compose.ha.yaml: the same ACL users and Redis settings as compose.yaml on both data nodes,
workers pointed at its sentinels, and its start scripts really build a Sentinel setup.

The scripts of the data nodes and the sentinels are run here with ``sh`` as Compose would
(``$$`` unescaped, the variables in the environment), against this machine's redis-server,
on loopback: a shim adds a free port, and compose's hostnames become 127.0.0.1 (docker is
not available here).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from producer.stack.local import free_port, redis_server_binary
from shared.acl import rules

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ROLE_OF = {"default": "admin", "producer": "producer", "worker": "worker", "operator": "operator"}


def _compose(name: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / name).read_text())


def _script(service: dict[str, Any]) -> str:
    return str(service["command"][0])


def test_both_data_nodes_have_the_users_and_settings_of_compose_yaml() -> None:
    ha, plain = _compose("compose.ha.yaml")["services"], _compose("compose.yaml")["services"]
    plain_users = [ln for ln in _script(plain["redis"]).splitlines() if ln.startswith("user ")]
    for node in ("redis-primary", "redis-replica"):
        script = _script(ha[node])
        users = [ln for ln in script.splitlines() if ln.startswith("user ")]
        assert users == plain_users, node
        for user in (u.split() for u in users):
            name, _on, _password, *rule = user[1:]
            assert rule == rules(ROLE_OF[name], 0, (7, 4)), name
        conf = script.split("cat > /tmp/redis.conf <<EOF", 1)[1].split("EOF", 1)[0].split()
        server = next(ln for ln in _script(plain["redis"]).splitlines() if "redis-server" in ln)
        flags = server.split()
        for flag in ("appendonly", "notify-keyspace-events", "appendfsync"):
            assert conf[conf.index(flag) + 1] == flags[flags.index(f"--{flag}") + 1], flag
    assert ha["redis-replica"]["environment"]["ROLE_ARGS"] == "replicaof redis-primary 6379"
    assert ha["redis-primary"]["environment"]["ROLE_ARGS"] == ""


def test_workers_find_the_primary_through_the_sentinels_of_this_file() -> None:
    services = _compose("compose.ha.yaml")["services"]
    sentinels = sorted(n for n in services if n.startswith("sentinel-"))
    assert len(sentinels) == 3
    monitor = next(
        ln.split() for ln in _script(services[sentinels[0]]).splitlines() if "monitor" in ln
    )
    for name in ("worker-text", "worker-image"):
        env = services[name]["environment"]
        assert json.loads(env["FLEET_REDIS__SENTINELS"]) == [f"{s}:26379" for s in sentinels]
        assert env["FLEET_REDIS__MASTER_NAME"] == monitor[2]
        assert env["FLEET_REDIS__USER"] == "worker"
        assert set(services[name]["depends_on"]) == set(sentinels)
    assert monitor[3:5] == ["redis-primary", "6379"] and monitor[5] == "2"  # quorum 2 of 3


def _start(script: str, env: dict[str, str], shim_dir: Path, port: int) -> subprocess.Popen[bytes]:
    shim_dir.mkdir(parents=True)
    shim = shim_dir / "redis-server"
    shim.write_text(
        f'#!/bin/sh\nexec {redis_server_binary()} "$@" --port {port} --bind 127.0.0.1 '
        f"--dir {shim_dir}\n"
    )
    shim.chmod(0o755)
    cli = Path(redis_server_binary()).parent
    full = {"PATH": f"{shim_dir}:{cli}:{os.environ['PATH']}", **env}
    return subprocess.Popen(["sh", "-c", script], env=full, stdout=subprocess.DEVNULL)


def test_the_start_scripts_build_a_sentinel_setup_that_fails_over(tmp_path: Path) -> None:
    services = _compose("compose.ha.yaml")["services"]
    pw = {r: secrets.token_urlsafe(16) for r in ("ADMIN", "PRODUCER", "WORKER", "OPERATOR")}
    pw["SENTINEL"] = secrets.token_urlsafe(16)
    env = {f"FLEET_REDIS_{r}_PASSWORD": p for r, p in pw.items()}
    ports = {n: free_port() for n in ("redis-primary", "redis-replica")}
    sports = [free_port() for _ in range(3)]
    procs = []

    def localise(script: str, name: str) -> str:
        out = script.replace("$$", "$").replace("/tmp/", f"{tmp_path}/{name}-")
        return out.replace("redis-primary 6379", f"127.0.0.1 {ports['redis-primary']}")

    try:
        for name, port in ports.items():
            role = services[name]["environment"]["ROLE_ARGS"]
            role = role.replace("redis-primary 6379", f"127.0.0.1 {ports['redis-primary']}")
            node_env = {**env, "NODE_NAME": "127.0.0.1", "ROLE_ARGS": role}
            procs.append(
                _start(localise(_script(services[name]), name), node_env, tmp_path / name, port)
            )
        for i, port in enumerate(sports):
            name = f"sentinel-{i + 1}"
            s_env = {**env, "NODE_NAME": "127.0.0.1"}
            procs.append(
                _start(localise(_script(services[name]), name), s_env, tmp_path / name, port)
            )
        sentinel = redis.Redis(port=sports[0], password=pw["SENTINEL"], socket_timeout=2)
        deadline = time.monotonic() + 60
        while True:  # the sentinels find the replica (INFO every 10 s) and each other
            try:
                m = sentinel.sentinel_master("mmfleet")
                if int(m["num-slaves"]) == 1 and int(m["num-other-sentinels"]) == 2:
                    break
            except redis.RedisError:
                pass
            assert time.monotonic() < deadline, "no settled sentinel setup"
            assert all(p.poll() is None for p in procs)
            time.sleep(0.5)
        assert int(m["port"]) == ports["redis-primary"]
        producer = redis.Redis(
            port=ports["redis-primary"], username="producer", password=pw["PRODUCER"]
        )
        assert producer.lpush("text", "x") == 1
        assert producer.execute_command("WAIT", 1, 2000) == 1  # the producer may WAIT
        deadline = time.monotonic() + 30
        while True:  # a replica the sentinels met a moment ago may not be eligible yet
            try:
                sentinel.execute_command("SENTINEL", "FAILOVER", "mmfleet")
                break
            except redis.ResponseError as exc:
                assert "NOGOODSLAVE" in str(exc) and time.monotonic() < deadline, exc
                time.sleep(0.5)
        deadline = time.monotonic() + 30
        while sentinel.sentinel_get_master_addr_by_name("mmfleet")[1] != ports["redis-replica"]:
            assert time.monotonic() < deadline, "no failover"
            time.sleep(0.2)
        new = redis.Redis(port=ports["redis-replica"], username="producer", password=pw["PRODUCER"])
        assert new.llen("text") == 1  # the acknowledged write survived
        old = redis.Redis(port=ports["redis-primary"], password=pw["ADMIN"])
        deadline = time.monotonic() + 10  # the reconfig script demotes the old primary
        while old.info("replication")["role"] != "slave":
            assert time.monotonic() < deadline, "old primary not demoted"
            time.sleep(0.2)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)
