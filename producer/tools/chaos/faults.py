"""The faults the drills inject, in one table: :data:`FAULTS`, name -> how it is injected,
what ends it, and which drill uses it (``fleet chaos`` with ``configs/chaos.toml``; the HA
drill, ``producer.tools.chaos.ha``).

A fault is a function of a context: it does its harm to real processes and a real Redis and
returns when the harm is over. It stamps the moment the fault ended (:meth:`Ctx.end`:
recovery is timed from there) and records the processes it killed on purpose (a
supervisor's restart of those is timed apart, and their exit is not held against the
fleet). Every wait is bounded. The chaos drill's faults take a :class:`ChaosCtx` (the
scenario's :class:`FaultParams`, the steady load), the HA drill's a :class:`FailoverCtx`
(the primary before the fault, and after it).

Scenarios name their fault: a chaos scenario's ``fault`` is checked against this table when
the scenario file is read, the HA drill's scenario names when its module is imported
(:func:`fault_named`, :func:`drill_faults`); an unknown name, or a fault of the other drill,
fails there, with the names there are.

How to add a fault: write its function here, ``def name(ctx: ChaosCtx) -> None`` (or
``FailoverCtx`` for the HA drill), which does the harm, calls ``ctx.end()`` when the fault
is over (at a kill; once what it withheld is given back), adds to ``ctx.targeted`` each
process it kills on purpose, and bounds every wait; it reads its parameters from
``ctx.sc`` (add a field to :class:`FaultParams` if none fits). Add
``"name": Fault(inject=name, ends="...", drills=("chaos",))`` to :data:`FAULTS`. For the
chaos drill, add a ``[[scenarios]]`` entry with ``fault = "name"`` to ``configs/chaos.toml``
(``tests/unit/test_chaos.py`` checks that each chaos fault has one) and describe its
parameters in that file's header; for the HA drill, add the name to
``producer.tools.chaos.ha.SCENARIOS``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import redis
from pydantic import BaseModel, ConfigDict, Field

from producer.client import FleetClient
from producer.stack import sentinel
from producer.stack.local import Stack
from producer.tools.chaos.aof_tmpfs import AofOnTmpfs
from producer.tools.chaos.faketime import skewed_env
from producer.tools.chaos.gateway_load import GatewayLoad
from producer.tools.chaos.load import Load, texts
from producer.tools.chaos.tally import Seen
from shared import schema
from shared.redis_client import sentinel_node

Drill = Literal["chaos", "ha"]


class FaultParams(BaseModel):
    """What a chaos scenario tells its fault; each fault reads the fields it needs.
    ``target`` names a process of the stack (``worker-text-1``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    target: str = "worker-text"
    times: int = Field(default=1, ge=1)
    interval_s: float = Field(default=5.0, ge=0.0)
    seconds: float = Field(default=5.0, ge=0.0)
    count: int = Field(default=20, ge=1)
    modality: Literal["text", "video"] = "text"  # video: needs the video worker


@dataclass(kw_only=True)
class Ctx:
    """What a fault acts on and where it records what it did."""

    stack: Stack
    seen: Seen
    targeted: set[str] = field(default_factory=set)  # processes the fault killed on purpose

    def end(self) -> None:
        self.seen.fault_end_s = time.monotonic()


@dataclass(kw_only=True)
class ChaosCtx(Ctx):
    """A chaos scenario's fault: its parameters, the client and Redis connection it may use,
    the steady load running meanwhile, and the restarts it started in the background."""

    client: FleetClient
    r: redis.Redis
    load: Load
    sc: FaultParams
    restarts: list[threading.Thread] = field(default_factory=list)


@dataclass(kw_only=True)
class FailoverCtx(Ctx):
    """An HA scenario's fault: the primary before it, and the one the sentinels named after
    it (``None`` if none within :data:`FAILOVER_TIMEOUT_S`)."""

    before: tuple[str, int] | None
    after: tuple[str, int] | None = None


def parse_target(name: str) -> tuple[str, int]:
    """``worker-text-1`` -> ``("text", 1)``; ``worker-video`` -> ``("video", 0)``."""
    parts = name.removeprefix("worker-").split("-")
    return parts[0], int(parts[1]) if len(parts) > 1 else 0


def pid_of(st: Stack, name: str) -> int:
    pid = st._read_pid(st.pids / f"{name}.pid")
    if pid is None:
        raise RuntimeError(f"{name} is not running")
    return pid


def restart_later(ctx: ChaosCtx, name: str) -> None:
    """Start ``name`` again in the background, as a supervisor would; timed."""

    def run() -> None:
        t0 = time.monotonic()
        ctx.stack.stop(name, timeout_s=1)
        modality, instance = parse_target(name)
        ctx.stack.start_worker(modality, instance=instance)
        ctx.seen.restart_s.append(time.monotonic() - t0)

    t = threading.Thread(target=run, name=f"chaos-restart-{name}", daemon=True)
    t.start()
    ctx.restarts.append(t)


def wait_holding(ctx: ChaosCtx, queue: str, timeout_s: float = 20.0) -> bool:
    """Wait until some worker holds a message of ``queue`` (its unacked entry exists)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for raw in ctx.r.hvals(schema.UNACKED_KEY):
            if f'"routing_key": "{queue}"'.encode() in raw or f'"{queue}"]'.encode() in raw:
                return True
        time.sleep(0.05)
    return False


def sigkill(ctx: ChaosCtx) -> None:
    for i in range(ctx.sc.times):
        if i:
            for t in ctx.restarts:
                t.join(120)
            time.sleep(ctx.sc.interval_s)
        os.killpg(pid_of(ctx.stack, ctx.sc.target), signal.SIGKILL)
        ctx.targeted.add(ctx.sc.target)
        ctx.end()
        restart_later(ctx, ctx.sc.target)


def sigstop(ctx: ChaosCtx) -> None:
    pid = pid_of(ctx.stack, ctx.sc.target)
    os.killpg(pid, signal.SIGSTOP)
    try:
        time.sleep(ctx.sc.seconds)
    finally:
        os.killpg(pid, signal.SIGCONT)
    ctx.end()


def sigterm(ctx: ChaosCtx) -> None:
    """A deploy while a long video runs: SIGTERM, wait for the graceful exit, restart."""
    for _ in range(2):
        ctx.load.video()
    wait_holding(ctx, schema.queue_name(ctx.sc.modality))
    time.sleep(0.5)
    ctx.targeted.add(ctx.sc.target)
    ctx.stack.stop(ctx.sc.target, timeout_s=60)
    ctx.end()
    restart_later(ctx, ctx.sc.target)


def video_sigkill(ctx: ChaosCtx) -> None:
    """Kill the video worker while it holds videos whose inputs live in /dev/shm."""
    for _ in range(2):
        ctx.load.video()
    wait_holding(ctx, schema.queue_name("video"))
    time.sleep(0.5)
    os.killpg(pid_of(ctx.stack, ctx.sc.target), signal.SIGKILL)
    ctx.targeted.add(ctx.sc.target)
    ctx.end()
    restart_later(ctx, ctx.sc.target)


def redis_restart(ctx: ChaosCtx) -> None:
    """SIGKILL redis-server and start it again from its AOF on the same port."""
    os.kill(pid_of(ctx.stack, "redis"), signal.SIGKILL)
    end = time.monotonic() + 10
    while ctx.stack.alive("redis") and time.monotonic() < end:
        time.sleep(0.02)
    ctx.stack.start_redis()
    ctx.end()


def client_kill(ctx: ChaosCtx) -> None:
    """``CLIENT KILL`` every connection but this one (workers first among them)."""
    me = ctx.r.client_id()
    for c in ctx.r.client_list():
        if int(c["id"]) != me:
            with contextlib.suppress(redis.RedisError):
                ctx.r.client_kill_filter(_id=c["id"])
    ctx.end()


def duplicates(ctx: ChaosCtx) -> None:
    """Publish a second message for ``count`` task ids already sent (finished or not)."""
    end = time.monotonic() + 30
    while time.monotonic() < end and len(ctx.load.order) < ctx.sc.count * 1.2:
        time.sleep(0.1)
    with ctx.load._lock:
        ids = [i for i in ctx.load.order if ctx.load.handles[i].envelope.modality == "text"]
    picked = ids[-ctx.sc.count :]
    with ctx.client.app.producer_or_acquire() as producer:
        for tid in picked:
            env = ctx.load.handles[tid].envelope
            ctx.client.publish(producer, env, tid, schema.queue_for("text", env.priority), 9)
    ctx.end()


MALFORMED_BODIES = ("not a list", [1, 2], {"args": 1}, [[], "kwargs-not-a-dict", {}], None)


def malformed(ctx: ChaosCtx) -> None:
    """``count`` bodies that are not Celery's ``[args, kwargs, embed]``, with task ids."""
    with ctx.client.app.producer_or_acquire() as producer:
        for i in range(ctx.sc.count):
            tid = str(uuid.uuid4())
            producer.publish(
                MALFORMED_BODIES[i % len(MALFORMED_BODIES)],
                exchange="",
                routing_key=schema.queue_name("text"),
                headers={"id": tid, "task": schema.task_name("text"), "lang": "py"},
                serializer="json",
            )
            ctx.seen.sent.append(tid)
            time.sleep(0.05)
    ctx.end()


def results_refused(ctx: ChaosCtx) -> None:
    """The workers' result writes refused for ``seconds``: an ACL rule denies the scripts
    (EVALSHA/EVAL) they store final results with, for the ACL user workers connect as."""
    user = ctx.stack.s.redis_credentials("worker")[0] or "default"
    ctx.r.execute_command("ACL", "SETUSER", user, "-evalsha", "-eval")
    try:
        time.sleep(ctx.sc.seconds)
    finally:
        ctx.r.execute_command("ACL", "SETUSER", user, "+evalsha", "+eval")
    ctx.end()


def results_halfway(ctx: ChaosCtx) -> None:
    """The workers' result writes refused halfway through their script for ``seconds``: an
    ACL rule denies the workers' user ``SETEX`` (the result document) for the first half,
    then ``SET`` (the final marker) for the second. Whichever the script writes first, one
    half refuses the command after that first write, and Redis keeps what a script wrote
    before a refused command: a marker left without its document would read PENDING for a
    day while the worker's retry counted it stored."""
    user = ctx.stack.s.redis_credentials("worker")[0] or "default"
    half = ctx.sc.seconds / 2
    for command in ("setex", "set"):
        ctx.r.execute_command("ACL", "SETUSER", user, f"-{command}")
        try:
            time.sleep(half)
        finally:
            ctx.r.execute_command("ACL", "SETUSER", user, f"+{command}")
    ctx.end()


def disk_full(ctx: ChaosCtx) -> None:
    """The disk under Redis's AOF full for ``seconds``: the drill moves the AOF to a tmpfs
    of its own and fills it (``producer.tools.chaos.aof_tmpfs``; needs mount permission). Redis
    refuses every write, and PING, with ``MISCONF`` until the filler is removed; the fault
    ends once it accepts writes again (the AOF then moves back to the run directory)."""
    with AofOnTmpfs(ctx.r) as aof:
        aof.fill()
        try:
            time.sleep(ctx.sc.seconds)
        finally:
            aof.free()
        ctx.end()


CLOCK_SKEWS_S = (3600.0, -3600.0)
PROBE_TIMEOUT_S = 30.0  # a deadline only a clock an hour off could make a probe miss
PROBE_EVERY_S = 0.25


def clock_skew(ctx: ChaosCtx) -> None:
    """One worker's wall clock an hour ahead for ``seconds``, then an hour behind for
    ``seconds``, the machine's and Redis' clocks untouched: the target is stopped (SIGTERM:
    it gives back what it holds) and started again under libfaketime
    (``producer.tools.chaos.faketime``) for each offset. While it runs skewed, probes (NORMAL
    texts with a ``PROBE_TIMEOUT_S`` deadline, ``Seen.probes``) go out beside the load: the
    scenario's ``fail_states`` (DEADLINE_EXCEEDED) count against them only, since the load's
    0.2 s REALTIME deadlines can be missed by any busy machine. The fault ends there; the
    worker is then restarted with its true clock, as a supervisor would (timed). Before the
    fleet kept time by Redis (``shared.clock``), the worker ahead failed every request with
    a deadline it took and took other workers' leases for lapsed; the one behind looked dead
    to producers.

    Raises:
        producer.tools.chaos.faketime.FaketimeUnavailable: libfaketime or cc is missing.
    """
    modality, instance = parse_target(ctx.sc.target)
    envs = [skewed_env(off, ctx.stack.dir / "faketime") for off in CLOCK_SKEWS_S]
    ctx.targeted.add(ctx.sc.target)
    n = 0
    for env in envs:
        ctx.stack.stop(ctx.sc.target, timeout_s=30)
        ctx.stack.start_worker(modality, instance=instance, extra_env=env)
        end = time.monotonic() + ctx.sc.seconds
        while time.monotonic() < end:
            n += 1
            text = f"Probe {n}: the ferry leaves the harbour at dawn."
            handle = ctx.client.submit("text", {"text": text}, "normal", PROBE_TIMEOUT_S)
            ctx.seen.sent.append(handle.id)
            ctx.seen.probes.append(handle.id)
            time.sleep(PROBE_EVERY_S)
    ctx.end()
    restart_later(ctx, ctx.sc.target)


GATEWAY_BURST = 64  # requests sent at once just before each gateway kill
GATEWAY_BURST_LEAD_S = 0.03  # they reach the gateway; most are being created when it dies


def gateway_sigkill(ctx: ChaosCtx) -> None:
    """The HTTP gateway SIGKILLed ``times`` times, ``interval_s`` apart, while ``count``
    requests go through it over ``seconds`` and a burst of :data:`GATEWAY_BURST` more has just
    reached it (``producer.tools.chaos.gateway_load``: each sent until the gateway accepts it, again
    with the same id after a lost answer, as the README advises), and started again at once,
    as a supervisor would. Its requests count with the scenario's: a job the kill stranded
    (recorded, its message never pushed) is lost."""
    st = ctx.stack
    if not st.alive("gateway"):
        st.start_gateway()
    rate = ctx.sc.count / max(ctx.sc.seconds, 0.1)
    gw = GatewayLoad(st.gateway_url(), st.s.gateway_token(), texts(), ctx.sc.count, rate, 0)
    gw.start()
    in_flight: list[int] = []
    try:
        for _ in range(ctx.sc.times):
            time.sleep(ctx.sc.interval_s)
            gw.burst(GATEWAY_BURST)  # the kill lands while the gateway creates these
            time.sleep(GATEWAY_BURST_LEAD_S)
            in_flight.append(gw.in_flight())
            os.killpg(pid_of(st, "gateway"), signal.SIGKILL)
            ctx.targeted.add("gateway")
            ctx.end()
            t0 = time.monotonic()
            st.stop("gateway", timeout_s=1)  # reaped, its pidfile gone
            st.start_gateway()
            ctx.seen.restart_s.append(time.monotonic() - t0)
        gw.finish()
    finally:
        ctx.seen.sent.extend(gw.tally.sent)
        st.stop("gateway")
    t = gw.tally
    ctx.seen.notes.update(
        gateway_sent=len(t.sent),
        gateway_accepted=len(t.accepted),
        gateway_retried=len(t.retried),
        gateway_in_flight_at_kills=in_flight,
        gateway_answers=dict(t.answers),
    )


FAILOVER_TIMEOUT_S = 60.0  # the HA faults end when the sentinels name a new primary, or this


def await_new_primary(ctx: FailoverCtx) -> None:
    """Wait until the sentinels name a primary other than ``ctx.before`` (``ctx.after``);
    the fault ends then, or after :data:`FAILOVER_TIMEOUT_S` without one."""
    end = time.monotonic() + FAILOVER_TIMEOUT_S
    while time.monotonic() < end:
        now = sentinel.current_primary(ctx.stack)
        if now is not None and now != ctx.before:
            ctx.after = now
            break
        time.sleep(0.05)
    ctx.end()


def sentinel_failover(ctx: FailoverCtx) -> None:
    """``SENTINEL FAILOVER <master>`` to the first sentinel (again while the sentinels have
    not judged the replica fit yet, for 30 s), then the wait for the new primary."""
    st = ctx.stack
    host, port = st.s.sentinel_addresses()[0]
    node = sentinel_node(st.s, host, port)
    deadline = time.monotonic() + 30
    while True:  # NOGOODSLAVE: the sentinels have not judged the replica fit yet
        try:
            node.execute_command("SENTINEL", "FAILOVER", st.s.redis.master_name)
            break
        except redis.ResponseError as exc:
            if "NOGOODSLAVE" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    await_new_primary(ctx)


def primary_sigkill(ctx: FailoverCtx) -> None:
    """SIGKILL of the primary's process; the sentinels promote the replica after
    ``down-after-milliseconds``. The HA drill starts the killed node again afterwards (a
    supervisor's job): it returns as a replica."""
    assert ctx.before is not None, "no primary to kill"
    st = ctx.stack
    victim = next(n for n in sentinel.NODES if sentinel.node_port(st, n) == ctx.before[1])
    os.kill(pid_of(st, victim), signal.SIGKILL)
    ctx.targeted.add(victim)
    await_new_primary(ctx)


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault.

    Attributes:
        inject: does the harm and returns when it is over (a function of the drill's
            context: :class:`ChaosCtx` or :class:`FailoverCtx`).
        ends: what ends it (the moment ``inject`` stamps with ``ctx.end()``).
        drills: the drills that use it.
    """

    inject: Callable[[Any], None]
    ends: str
    drills: tuple[Drill, ...]


CHAOS: tuple[Drill, ...] = ("chaos",)
HA: tuple[Drill, ...] = ("ha",)

FAULTS: dict[str, Fault] = {
    "sigkill": Fault(
        inject=sigkill,
        ends="each SIGKILL of the target (`times`, `interval_s` apart); restarted at once",
        drills=CHAOS,
    ),
    "sigstop": Fault(inject=sigstop, ends="SIGCONT to the target after `seconds`", drills=CHAOS),
    "sigterm": Fault(
        inject=sigterm,
        ends="the target's graceful exit (SIGTERM while it holds videos); restarted",
        drills=CHAOS,
    ),
    "video_sigkill": Fault(
        inject=video_sigkill,
        ends="SIGKILL of the video worker while it holds /dev/shm inputs; restarted",
        drills=CHAOS,
    ),
    "redis_restart": Fault(
        inject=redis_restart, ends="Redis started again from its AOF", drills=CHAOS
    ),
    "client_kill": Fault(
        inject=client_kill, ends="CLIENT KILL of every other connection", drills=CHAOS
    ),
    "duplicates": Fault(
        inject=duplicates, ends="`count` second publishes of sent task ids", drills=CHAOS
    ),
    "malformed": Fault(inject=malformed, ends="`count` malformed bodies published", drills=CHAOS),
    "results_refused": Fault(
        inject=results_refused,
        ends="the ACL rule on the workers' result scripts lifted after `seconds`",
        drills=CHAOS,
    ),
    "gateway_sigkill": Fault(
        inject=gateway_sigkill,
        ends="the last of `times` SIGKILLs of the gateway; restarted at once each time",
        drills=CHAOS,
    ),
    "results_halfway": Fault(
        inject=results_halfway,
        ends="the second of two ACL rules (SETEX, then SET) lifted, `seconds` in all",
        drills=CHAOS,
    ),
    "clock_skew": Fault(
        inject=clock_skew,
        ends="`seconds` an hour ahead and `seconds` behind; restarted with its true clock",
        drills=CHAOS,
    ),
    "disk_full": Fault(
        inject=disk_full,
        ends="the AOF's disk filler removed after `seconds`, Redis accepting writes",
        drills=CHAOS,
    ),
    "sentinel_failover": Fault(
        inject=sentinel_failover, ends="the sentinels name a new primary", drills=HA
    ),
    "primary_sigkill": Fault(
        inject=primary_sigkill,
        ends="the sentinels name a new primary; the killed node restarts as a replica",
        drills=HA,
    ),
}


def fault_named(name: str, drill: Drill) -> Fault:
    """The fault ``name`` of ``drill``.

    Raises:
        ValueError: no fault of ``drill`` has that name.
    """
    fault = FAULTS.get(name)
    if fault is None or drill not in fault.drills:
        known = ", ".join(n for n, f in FAULTS.items() if drill in f.drills)
        raise ValueError(f"unknown {drill} fault {name!r}; the {drill} drill's faults: {known}")
    return fault


def drill_faults(drill: Drill, *names: str) -> tuple[str, ...]:
    """``names``, each checked to be a fault of ``drill`` (:func:`fault_named`)."""
    for name in names:
        fault_named(name, drill)
    return names
