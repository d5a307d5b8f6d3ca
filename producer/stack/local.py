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

Modules (import every name from here): this one plans and starts the whole stack
(:class:`Stack`: ``up``, ``down``, the workers, Flower, the gateway, the exporter);
``producer.stack.procs`` spawns, waits for and stops its processes (pidfiles, logs);
``producer.stack.redis_node`` starts its Redis; ``producer.stack.state`` keeps ``stack.json``;
``producer.stack.ports`` checks and picks ports; ``producer.stack.sentinel`` starts the Sentinel
set.
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.request
from base64 import b64encode
from collections.abc import Callable, Mapping, Sequence, Set

from producer.stack import sentinel
from producer.stack.ports import (
    free_port,
    isolated_environment,
    parse_replicas,
    port_in_use,
    port_problem,
    replica_metrics_base,
    replica_metrics_port,
)
from producer.stack.procs import Proc, ProcessTable, StackError
from producer.stack.redis_node import RedisNode, redis_server_binary
from producer.stack.state import STATE_FILE, StackState
from shared.acl import ADMIN, ROLES
from shared.settings import MODALITIES, Settings, ensure_secret

__all__ = [
    "STATE_FILE",
    "PortInUse",
    "Proc",
    "Stack",
    "StackError",
    "free_port",
    "isolated_environment",
    "parse_replicas",
    "port_in_use",
    "port_problem",
    "redis_server_binary",
    "replica_metrics_base",
    "replica_metrics_port",
]


class PortInUse(StackError):
    """A port the stack would bind is taken; the message names the setting that moves it."""


class Stack(ProcessTable, RedisNode, StackState):
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

    def start_worker(
        self,
        modality: str,
        mode: str = "batch",
        instance: int = 0,
        extra_env: Mapping[str, str] | None = None,
    ) -> Proc:
        """Start a worker and wait until it answers a ping. ``instance`` > 0 starts another
        worker of the same modality (node ``text-1@host``, process ``worker-text-1``).
        ``extra_env``: variables for this worker only (a drill's skewed clock)."""
        node_name = f"{modality}-{instance}" if instance else modality
        env = {**self.env(), **extra_env} if extra_env else None
        proc = self._spawn(
            self.worker_name(modality, instance),
            self.worker_argv(modality, mode, replica=instance),
            env=env,
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
            "producer.ops.flower_app",
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

    # -- queue exporter -----------------------------------------------------------------
    def start_exporter(self) -> Proc:
        """Start ``fleet exporter`` (``producer.ops.exporter``) and wait until it serves."""
        from producer.ops.exporter import exporter_ok

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
            if self.s.ha:  # primary, replica, sentinels (producer.stack.sentinel)
                started += sentinel.start_all(self)
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
            out += sentinel.planned_ports(self)
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

    def down(
        self,
        timeout_s: float = 20.0,
        keep: Set[str] = frozenset(),
        before_redis: Callable[[], object] | None = None,
    ) -> list[str]:
        """Stop every process with a pidfile here (Redis last) but those named in ``keep``;
        return their names. ``before_redis`` runs once the others stopped, before Redis (and
        its sentinels) stop, when Redis is among the processes stopped (``fleet down``
        collects /dev/shm then, while Redis can still tell which requests are final)."""
        names = sorted(p.stem for p in self.pids.glob("*.pid")) if self.pids.exists() else []
        names = [n for n in names if n not in keep]
        # Redis last (workers ack on their way out); with HA the sentinels before the data
        # nodes (no failover while stopping), the replica before the primary.
        last = (*sorted(n for n in names if n.startswith("sentinel-")), "redis-replica", "redis")
        order = [n for n in names if n not in last] + [n for n in last if n in names]
        for name in order:
            if name in last and before_redis is not None:
                before_redis()
                before_redis = None
            self.stop(name, timeout_s)
        if not keep:
            (self.dir / STATE_FILE).unlink(missing_ok=True)
        return order

    # -- internals ----------------------------------------------------------------------
