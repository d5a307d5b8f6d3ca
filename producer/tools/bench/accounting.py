"""What each process and Redis spend per request: CPU from ``/proc``, Redis from ``INFO``.

Used by ``fleet bench`` when a workload sets ``accounting_idle_s`` (``overhead-saturate``),
and by ``producer/tools/bench/redisload.py`` (the Redis counters).

- **Processes.** ``/proc/<pid>/stat`` gives each process's ``utime + stime`` and, for the
  children it has reaped, ``cutime + cstime`` (clock ticks). A stack process's CPU is the sum
  of those four over its living process tree (its descendants by parent pid): a Celery
  worker's forks, Ray's raylet, GCS, proxy and replica processes. Two snapshots around a
  window, differenced per process (one that appeared inside the window counts from zero),
  give the CPU each process spent in it.
- **Redis.** ``INFO commandstats`` (calls and usec by command) and ``INFO cpu``
  (``used_cpu_sys + used_cpu_user``) before and after the window, minus the background
  measured over an idle window with the workers up (heartbeats, fetch polls, lease renewals),
  scaled to the window's length; the harness's own ``INFO`` calls are left out.
- **Redis outside its commands** (``redis_io_per_request``, not less the background): ``INFO
  stats`` bytes read and written on sockets, socket reads and writes, the kernel's share of
  the server's CPU (``used_cpu_sys``), and the CPU of the forks it reaped (an AOF rewrite:
  ``used_cpu_sys_children + used_cpu_user_children``, not in ``redis_cpu_us_per_request``);
  ``INFO clients``: connected clients and pubsub subscribers at the window's end.

Everything is divided by the requests completed inside the window. The pure parts
(:func:`parse_stat`, :func:`tree_ticks`, :func:`window_figures`, ...) take plain values and are
tested without servers.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "HARNESS_COMMANDS",
    "Accountant",
    "ProcStat",
    "Snapshot",
    "WindowSampler",
    "combine_windows",
    "completed_between",
    "counter_delta",
    "idle_rates",
    "idle_window",
    "load_window",
    "parse_stat",
    "process_role",
    "redis_counters",
    "redis_io",
    "redis_io_figures",
    "tree_ticks",
    "window_figures",
]

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
HARNESS_COMMANDS = ("info", "client")  # the snapshots' own INFO and CLIENT LIST: no request's
# cost (the fleet's clients send CLIENT only when they connect)
TOP_COMMANDS = 8


class ProcStat(NamedTuple):
    """One ``/proc/<pid>/stat`` line: ids and CPU in clock ticks."""

    pid: int
    comm: str
    ppid: int
    utime: int
    stime: int
    cutime: int
    cstime: int

    @property
    def ticks(self) -> int:
        """Its own CPU plus its reaped children's."""
        return self.utime + self.stime + self.cutime + self.cstime


def parse_stat(text: str) -> ProcStat:
    """Parse a ``/proc/<pid>/stat`` line (``comm`` may hold spaces and parentheses).

    Raises:
        ValueError: not a stat line.
    """
    try:
        head, rest = text.rsplit(")", 1)
        pid_s, comm = head.split("(", 1)
        f = rest.split()
        # fields after comm: state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14)
        return ProcStat(int(pid_s), comm, int(f[1]), int(f[11]), int(f[12]), int(f[13]),
                        int(f[14]))  # fmt: skip
    except (ValueError, IndexError) as exc:
        raise ValueError(f"not a /proc stat line: {text[:80]!r}") from exc


def read_procs(root: Path = Path("/proc")) -> dict[int, ProcStat]:
    """Every readable process's stat (processes that exit meanwhile are skipped)."""
    out: dict[int, ProcStat] = {}
    for d in root.iterdir():
        if not d.name.isdigit():
            continue
        try:
            out[int(d.name)] = parse_stat((d / "stat").read_text())
        except (OSError, ValueError):
            continue
    return out


def descendants(procs: Mapping[int, ProcStat], root: int) -> list[int]:
    """``root`` and every living descendant of it (by parent pid), ``root`` first."""
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    out, todo = [], [root] if root in procs else []
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def tree_ticks(procs: Mapping[int, ProcStat], root: int) -> dict[int, int]:
    """CPU ticks (own + reaped children's) of each process in ``root``'s tree, by pid."""
    return {pid: procs[pid].ticks for pid in descendants(procs, root)}


def tick_delta(before: Mapping[int, int], after: Mapping[int, int]) -> int:
    """Ticks spent between two :func:`tree_ticks` maps: per living process, after minus
    before (a process born in between from zero); a process gone by ``after`` is lost unless
    its parent reaped it (then its CPU is in the parent's ``cutime``)."""
    return sum(max(0, t - before.get(pid, 0)) for pid, t in after.items())


def process_role(name: str, cmdline: str = "") -> str:
    """The role a stack process's CPU is reported under.

    ``name`` is the stack's process name (pidfile): ``redis``, ``worker-text-1``,
    ``peer-ray-serve-text``, ``flower``, ``exporter``, ``gateway``; ``producer`` is the bench.
    ``cmdline`` (a process inside a Ray tree) splits Ray's processes into ``ray:<role>``.
    """
    if name.startswith(("worker-", "peer-celery-batches")):
        return "worker"
    if name.startswith("peer-ray-serve") and cmdline:
        return "ray:" + _ray_role(cmdline)
    if name.startswith("peer-"):
        return "worker"
    return name


def _ray_role(cmdline: str) -> str:
    argv0 = cmdline.split()[0] if cmdline.split() else ""
    base = argv0.rsplit("/", 1)[-1]
    if cmdline.startswith("ray::"):
        # ray::ServeReplica:app:Deployment, ray::ProxyActor, ray::ServeController, ray::IDLE
        return cmdline.removeprefix("ray::").split(":", 1)[0].split()[0].split(".")[0] or "actor"
    for known in ("raylet", "gcs_server"):
        if known in base:
            return known
    for known in ("dashboard", "log_monitor", "monitor.py", "runtime_env", "ray_app"):
        if known in cmdline:
            return {"monitor.py": "monitor", "ray_app": "driver"}.get(known, known)
    return "other"


# -- Redis counters --------------------------------------------------------------------------
def redis_counters(r: Any) -> tuple[dict[str, int], dict[str, int], float]:
    """(calls by command, usec inside each command, CPU seconds) of the server so far."""
    stats = r.info("commandstats")
    cpu = r.info("cpu")
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
    usec = {k.removeprefix("cmdstat_"): int(v["usec"]) for k, v in stats.items()}
    return calls, usec, float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


# INFO fields of :func:`redis_io`: counters (differenced over a window) and levels (its end)
REDIS_IO_COUNTERS = (
    "total_net_input_bytes",
    "total_net_output_bytes",
    "total_reads_processed",
    "total_writes_processed",
    "used_cpu_sys",
    "used_cpu_user",
    "used_cpu_sys_children",
    "used_cpu_user_children",
    "total_forks",
)
REDIS_IO_LEVELS = ("connected_clients", "pubsub_clients")


def redis_io(r: Any) -> dict[str, float]:
    """The server's I/O counters and client counts so far (:data:`REDIS_IO_COUNTERS`,
    :data:`REDIS_IO_LEVELS`; ``pubsub_clients``: clients subscribed to a channel or pattern,
    from ``CLIENT LIST``). A field this Redis does not report is left out."""
    info: dict[str, Any] = {}
    for section in ("stats", "cpu", "clients"):
        info.update(r.info(section))
    out = {k: float(info[k]) for k in (*REDIS_IO_COUNTERS, "connected_clients") if k in info}
    clients = r.client_list()
    out["pubsub_clients"] = float(
        sum(1 for c in clients if int(c.get("sub", 0) or 0) + int(c.get("psub", 0) or 0) > 0)
    )
    return out


def redis_io_figures(
    a: Mapping[str, float], b: Mapping[str, float], completed: int
) -> dict[str, float | None]:
    """Per request between two :func:`redis_io` readings: ``net_in_bytes``,
    ``net_out_bytes``, ``socket_reads``, ``socket_writes``, ``forked_cpu_us`` (AOF rewrites);
    ``kernel_share`` of the server's own CPU; ``connected_clients`` and ``pubsub_clients``
    at ``b``. Empty without completions or readings."""
    if completed <= 0 or not a or not b:
        return {}

    def d(k: str) -> float:
        return max(0.0, b.get(k, 0.0) - a.get(k, 0.0))

    own = d("used_cpu_sys") + d("used_cpu_user")
    forked = d("used_cpu_sys_children") + d("used_cpu_user_children")
    n = completed
    return {
        "net_in_bytes": round(d("total_net_input_bytes") / n, 1),
        "net_out_bytes": round(d("total_net_output_bytes") / n, 1),
        "socket_reads": round(d("total_reads_processed") / n, 3),
        "socket_writes": round(d("total_writes_processed") / n, 3),
        "kernel_share": round(d("used_cpu_sys") / own, 3) if own > 0 else None,
        "forked_cpu_us": round(forked * 1e6 / n, 2),
        "forks": round(d("total_forks"), 0),
        "connected_clients": b.get("connected_clients"),
        "pubsub_clients": b.get("pubsub_clients"),
    }


def counter_delta(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """``after - before`` per key, positive differences only."""
    return {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0) > 0}


# -- snapshots -------------------------------------------------------------------------------
@dataclass
class Snapshot:
    """CPU ticks by stack process (pid -> ticks, per role) and Redis's counters at ``t``."""

    t: float  # monotonic seconds
    ticks: dict[str, dict[int, int]] = field(default_factory=dict)  # role -> pid -> ticks
    calls: dict[str, int] = field(default_factory=dict)
    usec: dict[str, int] = field(default_factory=dict)
    redis_cpu_s: float = 0.0
    redis_io: dict[str, float] = field(default_factory=dict)


class Accountant:
    """Takes :class:`Snapshot` s of a stack's processes (by its pidfiles), the bench process
    (``producer``) and Redis (``admin``: a client that may run ``INFO``)."""

    def __init__(self, pids_dir: Path, admin: Any, proc_root: Path = Path("/proc")) -> None:
        self.pids_dir = pids_dir
        self.admin = admin
        self.proc_root = proc_root
        self._cmdlines: dict[int, str] = {}

    def _roots(self) -> dict[str, int]:
        out = {"producer": os.getpid()}
        for f in sorted(self.pids_dir.glob("*.pid")):
            try:
                out[f.stem] = int(f.read_text().strip())
            except (OSError, ValueError):
                continue
        return out

    def _cmdline(self, pid: int) -> str:
        if pid not in self._cmdlines:
            try:
                raw = (self.proc_root / str(pid) / "cmdline").read_bytes()
                self._cmdlines[pid] = raw.replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                self._cmdlines[pid] = ""
        return self._cmdlines[pid]

    def snapshot(self) -> Snapshot:
        procs = read_procs(self.proc_root)
        snap = Snapshot(time.monotonic())
        for name, root in self._roots().items():
            if name == "producer":  # the bench: its own process (generator, collector)
                if root in procs:
                    snap.ticks.setdefault("producer", {})[root] = procs[root].ticks
                continue
            for pid in descendants(procs, root):
                cmd = self._cmdline(pid) if name.startswith("peer-ray-serve") else ""
                role = process_role(name, cmd)
                snap.ticks.setdefault(role, {})[pid] = procs[pid].ticks
        snap.calls, snap.usec, snap.redis_cpu_s = redis_counters(self.admin)
        snap.redis_io = redis_io(self.admin)
        return snap


# -- figures ---------------------------------------------------------------------------------
def idle_rates(a: Snapshot, b: Snapshot) -> dict[str, Any]:
    """Background per second between two snapshots taken while nothing was sent: Redis's
    commands (by name), usec in commands (by name) and CPU seconds, and each role's CPU."""
    dt = max(b.t - a.t, 1e-9)
    calls = counter_delta(a.calls, b.calls)
    for cmd in HARNESS_COMMANDS:
        calls.pop(cmd, None)
    usec = counter_delta(a.usec, b.usec)
    for cmd in HARNESS_COMMANDS:
        usec.pop(cmd, None)
    return {
        "s": dt,
        "calls_per_s": {k: v / dt for k, v in calls.items()},
        "usec_per_s": {k: v / dt for k, v in usec.items()},
        "redis_cpu_s_per_s": max(0.0, b.redis_cpu_s - a.redis_cpu_s) / dt,
        "cpu_us_per_s": {
            role: tick_delta(a.ticks.get(role, {}), ticks) / CLK_TCK * 1e6 / dt
            for role, ticks in b.ticks.items()
        },
    }


def _less_background(
    delta: Mapping[str, float], rates: Mapping[str, float], dt: float
) -> dict[str, float]:
    """``delta`` minus ``rates`` x ``dt`` per key, floored at 0."""
    return {k: max(0.0, v - rates.get(k, 0.0) * dt) for k, v in delta.items()}


def window_figures(
    a: Snapshot, b: Snapshot, completed: int, idle: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """One window's costs per completed request.

    ``cpu_us_per_request`` by role (``producer``, ``redis`` from ``/proc``, ``worker``, Ray's
    roles, ...) plus ``total``; ``redis_cpu_us_per_request`` and ``redis_commands_per_request``
    from ``INFO`` less the ``idle`` background (:func:`idle_rates`) over the window, and
    ``redis_usec_by_command`` (usec per request, largest first); ``redis_io_per_request``
    (:func:`redis_io_figures`). ``cpu_cores`` by role: the CPU each role used per second of
    the window (1.0 = one core busy)."""
    dt = max(b.t - a.t, 1e-9)
    idle = idle or {}
    us = {
        role: tick_delta(a.ticks.get(role, {}), ticks) / CLK_TCK * 1e6
        for role, ticks in b.ticks.items()
    }
    calls = {k: float(v) for k, v in counter_delta(a.calls, b.calls).items()}
    usec = {k: float(v) for k, v in counter_delta(a.usec, b.usec).items()}
    for cmd in HARNESS_COMMANDS:
        calls.pop(cmd, None)
        usec.pop(cmd, None)
    calls = _less_background(calls, idle.get("calls_per_s", {}), dt)
    usec = _less_background(usec, idle.get("usec_per_s", {}), dt)
    redis_cpu = max(0.0, (b.redis_cpu_s - a.redis_cpu_s) - idle.get("redis_cpu_s_per_s", 0.0) * dt)
    n = completed
    out: dict[str, Any] = {
        "window_s": round(dt, 3),
        "completed": n,
        "rps": round(n / dt, 1),
        "cpu_cores": {role: round(v / dt / 1e6, 3) for role, v in sorted(us.items())},
        "cpu_us_per_request": per_request_us(us, n),
        "redis_cpu_us_per_request": None if n <= 0 else round(redis_cpu * 1e6 / n, 2),
        "redis_commands_per_request": None if n <= 0 else round(sum(calls.values()) / n, 3),
        "redis_calls_by_command": _top(calls, n, 3, limit=None),
        "redis_usec_by_command": _top(usec, n, 2),
        "redis_io_per_request": redis_io_figures(a.redis_io, b.redis_io, n),
    }
    return out


def per_request_us(us: Mapping[str, float], completed: int) -> dict[str, float | None]:
    """CPU microseconds per request by role, plus ``total``; ``None`` without completions.
    Ray's roles (``ray:*``) are also summed as ``worker`` (what serves, as for the other
    modes), not counted twice in ``total``."""
    roles = dict(us)
    ray = [v for k, v in us.items() if k.startswith("ray:")]
    if ray and "worker" not in roles:
        roles["worker"] = sum(ray)
    if completed <= 0:
        return {**{k: None for k in sorted(roles)}, "total": None}
    out: dict[str, float | None] = {k: round(v / completed, 1) for k, v in sorted(roles.items())}
    out["total"] = round(sum(us.values()) / completed, 1)
    return out


def _bound(us: list[Any]) -> float | None:
    """Requests/s at which Redis's one thread would be busy all the time: 1 s over the
    median Redis CPU per request (``None`` without one)."""
    vals = [x for x in us if x]
    return round(1e6 / statistics.median(vals)) if vals else None


def _top(
    values: Mapping[str, float], n: int, digits: int, limit: int | None = TOP_COMMANDS
) -> dict[str, float]:
    """``values`` per request, largest first, the first ``limit`` (``None``: all)."""
    if n <= 0:
        return {}
    ranked = sorted(((k, v / n) for k, v in values.items() if v > 0), key=lambda kv: -kv[1])
    return {k: round(v, digits) for k, v in ranked[:limit]}


def combine_windows(windows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Several repetitions' :func:`window_figures`: the median of every figure per key."""
    ws = [w for w in windows if w]
    if not ws:
        return {}

    def med(xs: list[Any]) -> float | None:
        vals = [x for x in xs if x is not None]
        return round(statistics.median(vals), 2) if vals else None

    def by_key(section: str) -> dict[str, float | None]:
        keys: list[str] = []
        for w in ws:
            keys += [k for k in w.get(section, {}) if k not in keys]
        return {k: med([w.get(section, {}).get(k) for w in ws]) for k in keys}

    return {
        "repetitions": len(ws),
        "window_s": med([w["window_s"] for w in ws]),
        "completed": sum(w["completed"] for w in ws),
        "rps": med([w["rps"] for w in ws]),
        "cpu_cores": by_key("cpu_cores"),
        "cpu_us_per_request": by_key("cpu_us_per_request"),
        "redis_cpu_us_per_request": med([w["redis_cpu_us_per_request"] for w in ws]),
        "redis_bound_rps": _bound([w["redis_cpu_us_per_request"] for w in ws]),
        "redis_commands_per_request": med([w["redis_commands_per_request"] for w in ws]),
        "redis_calls_by_command": by_key("redis_calls_by_command"),
        "redis_usec_by_command": dict(
            sorted(by_key("redis_usec_by_command").items(), key=lambda kv: -(kv[1] or 0))[
                :TOP_COMMANDS
            ]
        ),
        "redis_io_per_request": by_key("redis_io_per_request"),
    }


def load_window(w: Any) -> tuple[float, float]:
    """The accounted window of a repetition, in seconds from its start: from the workload's
    ``warmup_s`` to the end of its last timed phase (``start_s + duration_s``).

    Raises:
        ValueError: no phase has a ``duration_s`` (bursts and counts have no fixed window),
            or the warmup outlasts the load.
    """
    ends = [p.start_s + p.duration_s for p in w.phases if p.duration_s]
    if not ends or max(ends) <= w.warmup_s:
        raise ValueError("CPU accounting needs a phase with duration_s longer than warmup_s")
    return float(w.warmup_s), float(max(ends))


class WindowSampler(threading.Thread):
    """Takes a snapshot at monotonic ``t_a`` and another at ``t_b`` (and, with ``count``, a
    completions counter at each); :meth:`figures` after :meth:`join`."""

    def __init__(
        self,
        accountant: Accountant,
        t_a: float,
        t_b: float,
        count: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(name="bench-accounting", daemon=True)
        self.accountant = accountant
        self.t_a, self.t_b = t_a, t_b
        self.count = count
        self.a: Snapshot | None = None
        self.b: Snapshot | None = None
        self.counts: tuple[int, int] = (0, 0)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            _sleep_until(self.t_a)
            c0 = self.count() if self.count else 0
            self.a = self.accountant.snapshot()
            _sleep_until(self.t_b)
            c1 = self.count() if self.count else 0
            self.b = self.accountant.snapshot()
            self.counts = (c0, c1)
        except BaseException as exc:  # reported by the caller, never a crashed bench
            self.error = exc

    def figures(
        self, idle: Mapping[str, Any] | None, completed: int | None = None
    ) -> dict[str, Any]:
        """:func:`window_figures` of the two snapshots; ``completed`` defaults to the
        counter's difference. Empty when a snapshot failed."""
        if self.a is None or self.b is None:
            return {}
        n = self.counts[1] - self.counts[0] if completed is None else completed
        return window_figures(self.a, self.b, n, idle)


def _sleep_until(t: float) -> None:
    while (left := t - time.monotonic()) > 0:
        time.sleep(min(left, 0.1))


def idle_window(accountant: Accountant, seconds: float) -> dict[str, Any]:
    """The background rates (:func:`idle_rates`) over ``seconds`` of nothing sent."""
    a = accountant.snapshot()
    time.sleep(seconds)
    return idle_rates(a, accountant.snapshot())


def completed_between(records: Iterable[Any], a_ms: float, b_ms: float) -> int:
    """Successful records whose ``done_ms`` (wall clock, ms) lies in ``[a_ms, b_ms)``."""
    return sum(1 for r in records if r.ok and r.done_ms is not None and a_ms <= r.done_ms < b_ms)
