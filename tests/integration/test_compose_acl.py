"""compose.yaml's Redis: the same ACL users as shared.acl, and its start script really works.

The script in the ``redis`` service's ``command`` is run here with ``sh`` as Compose would
(``$$`` unescaped, the passwords in the environment), against this machine's redis-server
(a shim adds a free loopback port and a data directory).
"""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
import time
from pathlib import Path

import pytest
import redis
import yaml

from producer.stack.local import free_port, redis_server_binary
from shared.acl import rules

pytestmark = pytest.mark.integration

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"
ROLE_OF = {"default": "admin", "producer": "producer", "worker": "worker", "operator": "operator"}


def _script() -> str:
    return yaml.safe_load(COMPOSE.read_text())["services"]["redis"]["command"][0]


def test_compose_users_have_exactly_the_rules_of_shared_acl() -> None:
    users = [line.split() for line in _script().splitlines() if line.startswith("user ")]
    assert sorted(u[1] for u in users) == sorted(ROLE_OF)
    for user in users:
        name, on, password, *rule = user[1:]
        assert on == "on" and password.startswith(">$${FLEET_REDIS_")
        assert rule == rules(ROLE_OF[name], 0, (7, 4)), name


def test_the_compose_start_script_serves_each_user_with_its_rights(tmp_path: Path) -> None:
    port = free_port()
    shim = tmp_path / "bin" / "redis-server"
    shim.parent.mkdir()
    shim.write_text(
        f'#!/bin/sh\nexec {redis_server_binary()} "$@" --port {port} --bind 127.0.0.1 '
        f"--dir {tmp_path}\n"
    )
    shim.chmod(0o755)
    acl_file = tmp_path / "users.acl"
    script = _script().replace("$$", "$").replace("/tmp/users.acl", str(acl_file))
    passwords = {r: secrets.token_urlsafe(16) for r in ("ADMIN", "PRODUCER", "WORKER", "OPERATOR")}
    env = {
        "PATH": f"{shim.parent}:{os.environ['PATH']}",
        **{f"FLEET_REDIS_{r}_PASSWORD": p for r, p in passwords.items()},
    }
    proc = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.DEVNULL)
    try:

        def as_user(user: str | None, role: str) -> redis.Redis:
            return redis.Redis(port=port, username=user, password=passwords[role])

        admin = as_user(None, "ADMIN")
        deadline = time.monotonic() + 20
        while True:
            try:
                assert admin.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        producer = as_user("producer", "PRODUCER")
        assert producer.lpush("text", "x") == 1
        with pytest.raises(redis.exceptions.NoPermissionError):
            producer.execute_command("EVAL", "return 1", "0")
        with pytest.raises(redis.exceptions.NoPermissionError):
            producer.flushall()
        worker = as_user("worker", "WORKER")
        assert worker.eval("return 1", 0) == 1
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker.config_get("*")
        assert as_user("operator", "OPERATOR").info("server")["redis_version"]
        # the passwords are in the ACL file (0600), not on the server's command line
        assert stat.S_IMODE(acl_file.stat().st_mode) == 0o600
        pids = subprocess.run(
            ["pgrep", "-f", f"redis-server 127.0.0.1:{port}"], capture_output=True, text=True
        ).stdout.split()
        assert pids  # the server (sh exec'd into it; Redis sets its title to host:port)
        for pid in pids:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            assert not any(p in argv for p in passwords.values())
    finally:
        proc.terminate()
        proc.wait(timeout=10)
