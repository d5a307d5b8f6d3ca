"""The local stack's Redis in high-availability mode: a primary, a replica, three sentinels.

``fleet up --ha`` (``[redis] sentinels`` set) starts, from the same ``redis-server`` binary,
on loopback:

- ``redis`` (``[redis] port``) and ``redis-replica`` (port + 1): the same configuration
  (AOF on, the fleet's ACL users, ``notify-keyspace-events Kl`` for the workers' bell,
  ``masterauth`` so either can replicate from the other) but for ``replicaof`` on the
  node that starts as a replica. ACL users and ``CONFIG`` values are not replicated: each
  node has them from its own file, so a promoted replica serves the fleet exactly as the
  old primary did;
- ``sentinel-0`` .. ``sentinel-2`` (the ports of ``[redis] sentinels``): quorum 2, their own
  password (``requirepass``, and ``sentinel sentinel-pass`` among themselves), the admin's
  credentials for the data nodes (``sentinel auth-pass``; failover reconfigures them with
  ``REPLICAOF``, ``CONFIG REWRITE`` and ``CLIENT KILL``, which only the admin may run).

A node started again (after a crash) starts as a replica of whichever node the sentinels
name as primary now, so a restarted old primary never serves stale data as a primary.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from producer.stack.procs import Proc, StackError
from producer.stack.redis_node import redis_server_binary
from shared.acl import server_version
from shared.settings import Settings


class Host(Protocol):
    """What the Sentinel set needs of the stack that starts it (``producer.stack.local.Stack``)."""

    s: Settings
    dir: Path
    logs: Path

    def env(self) -> dict[str, str]: ...
    def alive(self, name: str) -> bool: ...
    def node_ping(self, port: int) -> bool: ...
    def _acl_lines(self, version: tuple[int, int]) -> list[str]: ...
    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc: ...
    def _wait(self, check: Callable[[], bool], what: str, proc: Proc, timeout_s: float) -> None: ...


NODES: tuple[str, str] = ("redis", "redis-replica")
QUORUM = 2


def sentinel_names(n: int) -> list[str]:
    """Process names of ``n`` sentinels: ``sentinel-0``..."""
    return [f"sentinel-{i}" for i in range(n)]


def node_port(stack: Host, name: str) -> int:
    """The port of data node ``name`` (``redis``: ``[redis] port``; the replica: + 1)."""
    return stack.s.redis.port + NODES.index(name)


def _write_private(path: Path, text: str) -> None:
    path.unlink(missing_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # never readable
    path.write_text(text)


def node_conf(
    stack: Host, name: str, version: tuple[int, int], primary: tuple[str, int] | None
) -> str:
    """``redis.conf`` of data node ``name``; ``primary``: replicate from it."""
    s, r = stack.s, stack.s.redis
    user, password = s.redis_credentials("admin")
    data = stack.dir / name
    data.mkdir(parents=True, exist_ok=True, mode=0o700)
    lines = [
        f"bind {r.host}",
        f"port {node_port(stack, name)}",
        "protected-mode yes",
        *stack._acl_lines(version),
        f"dir {data}",
        "appendonly yes",
        "appendfsync everysec",
        "notify-keyspace-events Kl",
        'save ""',
        f"logfile {stack.logs / (name + '.log')}",
        "daemonize no",
        f"masterauth {password}",
        *([f"masteruser {user}"] if user else []),
        "replica-read-only yes",
    ]
    if primary is not None:
        lines.append(f"replicaof {primary[0]} {primary[1]}")
    return "\n".join([*lines, ""])


def sentinel_conf(stack: Host, index: int, primary: tuple[str, int]) -> str:
    """The configuration of sentinel ``index`` monitoring ``primary``."""
    s, r = stack.s, stack.s.redis
    host, port = s.sentinel_addresses()[index]
    user, password = s.redis_credentials("admin")
    spw = s.sentinel_password()
    data = stack.dir / f"sentinel-{index}"
    data.mkdir(parents=True, exist_ok=True, mode=0o700)
    m = r.master_name
    script = reconfig_script(stack)
    return "\n".join(
        [
            f"bind {host}",
            f"port {port}",
            f"dir {data}",
            f"logfile {stack.logs / f'sentinel-{index}.log'}",
            "daemonize no",
            f"requirepass {spw}",
            f"sentinel sentinel-pass {spw}",
            f"sentinel monitor {m} {primary[0]} {primary[1]} {QUORUM}",
            f"sentinel down-after-milliseconds {m} {r.sentinel_down_after_ms}",
            f"sentinel failover-timeout {m} {r.sentinel_failover_timeout_ms}",
            f"sentinel parallel-syncs {m} 1",
            f"sentinel auth-pass {m} {password}",
            *([f"sentinel client-reconfig-script {m} {script}"] if script else []),
            *([f"sentinel auth-user {m} {user}"] if user else []),
            "",
        ]
    )


# Run by each sentinel when it switches the master (args: master-name role state from-ip
# from-port to-ip to-port). A sentinel demotes a reachable old primary only after it has
# reported "master" for several INFO periods (about 10 s), and until then clients still
# connected to it write there, writes lost when it is demoted: demote it at once, and drop
# its clients so they ask the sentinels again. Exit 0 always: a dead old primary (SIGKILL)
# is no reason for the sentinel to retry.
_RECONFIG_SH = """#!/bin/sh
[ "$#" -ge 7 ] || exit 0
CLI={cli}
$CLI -h "$4" -p "$5" {user}--no-auth-warning REPLICAOF "$6" "$7" >/dev/null 2>&1
$CLI -h "$4" -p "$5" {user}--no-auth-warning CLIENT KILL TYPE normal >/dev/null 2>&1
$CLI -h "$4" -p "$5" {user}--no-auth-warning CLIENT KILL TYPE pubsub >/dev/null 2>&1
exit 0
"""


def redis_cli_binary() -> str | None:
    """``redis-cli`` beside the ``redis-server`` in use, else on PATH; ``None`` if neither."""
    import shutil

    beside = Path(redis_server_binary()).parent / "redis-cli"
    return str(beside) if beside.exists() else shutil.which("redis-cli")


def reconfig_script(stack: Host) -> Path | None:
    """Write the sentinels' ``client-reconfig-script`` (0700); ``None`` without redis-cli.
    The admin password reaches it through ``REDISCLI_AUTH`` in the sentinels' environment."""
    cli = redis_cli_binary()
    if cli is None:
        return None
    user, _ = stack.s.redis_credentials("admin")
    path = stack.dir / "sentinel-reconfig.sh"
    path.write_text(_RECONFIG_SH.format(cli=cli, user=f"--user {user} " if user else ""))
    path.chmod(0o700)
    return path


def current_primary(stack: Host) -> tuple[str, int] | None:
    """The primary the first answering sentinel names, else ``None`` (none running)."""
    from shared.redis_client import sentinel_node

    for host, port in stack.s.sentinel_addresses():
        try:
            addr = sentinel_node(stack.s, host, port).sentinel_get_master_addr_by_name(
                stack.s.redis.master_name
            )
        except Exception:
            continue
        if addr:
            host = addr[0].decode() if isinstance(addr[0], bytes) else str(addr[0])
            return host, int(addr[1])
    return None


def start_node(stack: Host, name: str) -> Proc:
    """Start data node ``name``: a replica of the sentinels' primary when they name one
    that is not this node; else the primary (``redis``) or its replica."""

    binary = redis_server_binary()
    host, port = stack.s.redis.host, node_port(stack, name)
    primary = current_primary(stack)
    if primary is None:
        primary = None if name == "redis" else (host, node_port(stack, "redis"))
    elif primary == (host, port):
        primary = None
    conf = stack.dir / f"{name}.conf"
    _write_private(conf, node_conf(stack, name, server_version(binary), primary))
    proc = stack._spawn(name, [binary, str(conf)])
    stack._wait(lambda: stack.node_ping(port), name, proc, 30.0)
    return proc


def start_sentinel(stack: Host, index: int) -> Proc:
    """Start sentinel ``index`` and wait until it answers PING."""

    binary = redis_server_binary()
    name = f"sentinel-{index}"
    primary = current_primary(stack) or (stack.s.redis.host, node_port(stack, "redis"))
    conf = stack.dir / f"{name}.conf"  # the sentinel rewrites it: its state lives there
    _write_private(conf, sentinel_conf(stack, index, primary))
    env = stack.env()
    env["REDISCLI_AUTH"] = stack.s.redis_credentials("admin")[1]  # for reconfig_script
    proc = stack._spawn(name, [binary, str(conf), "--sentinel"], env=env)
    host, port = stack.s.sentinel_addresses()[index]
    stack._wait(lambda: _sentinel_ping(stack, host, port), name, proc, 30.0)
    return proc


def _sentinel_ping(stack: Host, host: str, port: int) -> bool:
    from shared.redis_client import sentinel_node

    try:
        return bool(sentinel_node(stack.s, host, port).ping())
    except Exception:
        return False


def settled(stack: Host) -> dict[str, Any] | None:
    """The first sentinel's view of the master when every sentinel sees it ``ok`` with one
    replica and all sentinels (a failover can then succeed); else ``None``."""
    from shared.redis_client import sentinel_node

    want = len(stack.s.sentinel_addresses())
    view = None
    for host, port in stack.s.sentinel_addresses():
        try:
            m = sentinel_node(stack.s, host, port).sentinel_master(stack.s.redis.master_name)
        except Exception:
            return None
        flags = str(m.get("flags", ""))
        if (
            "s_down" in flags
            or "o_down" in flags
            or int(m.get("num-slaves", 0)) < 1
            or int(m.get("num-other-sentinels", 0)) < want - 1
        ):
            return None
        view = view or m
    return view


def wait_settled(stack: Host, timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait until :func:`settled`; return its view.

    Raises:
        StackError: not settled within ``timeout_s``.
    """

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = settled(stack)
        if view is not None:
            return view
        time.sleep(0.25)
    raise StackError(f"the sentinels did not see a primary with a replica within {timeout_s:.0f} s")


def start_all(stack: Host) -> list[Proc]:
    """Start what is not running of the primary, the replica and the sentinels; return
    when the sentinels agree on a primary with its replica."""
    started = [start_node(stack, n) for n in NODES if not stack.alive(n)]
    n = len(stack.s.sentinel_addresses())
    started += [start_sentinel(stack, i) for i in range(n) if not stack.alive(f"sentinel-{i}")]
    wait_settled(stack)
    return started


def planned_ports(stack: Host) -> list[tuple[str, str, int, str, str]]:
    """``(process, host, port, what, setting)`` of the replica and the sentinels that are
    not running yet (the primary is the plain stack's ``redis``)."""
    out = []
    if not stack.alive("redis-replica"):
        port = node_port(stack, "redis-replica")
        out.append(
            (
                "redis-replica",
                stack.s.redis.host,
                port,
                "the Redis replica ([redis] port + 1)",
                "FLEET_REDIS__PORT",
            )
        )
    for i, (host, port) in enumerate(stack.s.sentinel_addresses()):
        if not stack.alive(f"sentinel-{i}"):
            out.append((f"sentinel-{i}", host, port, f"sentinel {i}", "FLEET_REDIS__SENTINELS"))
    return out
