"""deploy/k8s's Redis start script really works: run with ``sh`` as the container runs it
(the passwords in the environment, as the Secret puts them there), against this machine's
redis-server (a shim adds a free loopback port; the data directory is a temporary one)."""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
import time
from pathlib import Path

import pytest
import redis

from producer.stack.local import free_port, redis_server_binary
from tests.deploy.test_manifests import of_kind, redis_script, render

pytestmark = pytest.mark.integration


def test_the_redis_start_script_serves_each_user_with_its_rights(tmp_path: Path) -> None:
    port = free_port()
    shim = tmp_path / "bin" / "redis-server"
    shim.parent.mkdir()
    shim.write_text(
        f'#!/bin/sh\nexec {redis_server_binary()} "$@" --port {port} --bind 127.0.0.1\n'
    )
    shim.chmod(0o755)
    objs = render("cpu")
    acl_file = tmp_path / "users.acl"
    # Redis changes into --dir as it parses it: the PVC's mount point becomes tmp_path
    script = (
        redis_script(objs)
        .replace("/run/redis-acl/users.acl", str(acl_file))
        .replace("--dir /data", f"--dir {tmp_path}")
    )
    # the variables the container gets from the Secret
    (c,) = of_kind(objs, "StatefulSet")["redis"]["spec"]["template"]["spec"]["containers"]
    names = [e["name"] for e in c["env"]]
    passwords = {n: secrets.token_urlsafe(16) for n in names}
    env = {"PATH": f"{shim.parent}:{os.environ['PATH']}", **passwords}
    proc = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.DEVNULL)
    try:

        def as_user(user: str | None, var: str) -> redis.Redis:
            return redis.Redis(port=port, username=user, password=passwords[var])

        admin = as_user(None, "FLEET_REDIS_ADMIN_PASSWORD")
        deadline = time.monotonic() + 20
        while True:
            try:
                assert admin.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        assert admin.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        assert admin.config_get("appendonly")["appendonly"] == "yes"
        producer = as_user("producer", "FLEET_REDIS_PRODUCER_PASSWORD")
        assert producer.lpush("text", "x") == 1
        with pytest.raises(redis.exceptions.NoPermissionError):
            producer.execute_command("EVAL", "return 1", "0")
        worker = as_user("worker", "FLEET_REDIS_WORKER_PASSWORD")
        assert worker.eval("return 1", 0) == 1
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker.config_get("*")
        assert as_user("operator", "FLEET_REDIS_OPERATOR_PASSWORD").info("server")
        assert stat.S_IMODE(acl_file.stat().st_mode) == 0o600
        pids = subprocess.run(
            ["pgrep", "-f", f"redis-server 127.0.0.1:{port}"], capture_output=True, text=True
        ).stdout.split()
        assert pids
        for pid in pids:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            assert not any(p in argv for p in passwords.values())
    finally:
        proc.terminate()
        proc.wait(timeout=10)
