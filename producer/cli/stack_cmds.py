"""``fleet worker|up|down|status|flower|redis-url|gateway|exporter|demo``: the processes of a
stack and how to reach them."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Annotated

import typer

from producer.cli.base import MODEL_ENV, CliProblem, ExitCode, app, cli_settings, emit
from shared.settings import MODALITIES

if TYPE_CHECKING:
    from producer.stack.local import Proc, Stack
    from shared.settings import Settings

DEFAULT_SENTINEL_PORTS = (26379, 26380, 26381)  # `fleet up --ha` without [redis] sentinels


@app.command()
def worker(
    modality: Annotated[str, typer.Argument(help="text, image, video or xmodal")],
    mode: Annotated[str, typer.Option(help="batch (the fleet) or baseline (plain Celery)")] = (
        "batch"
    ),
    prefetch: Annotated[int, typer.Option(help="prefetch window; 0 = from config")] = 0,
    loglevel: Annotated[str, typer.Option("--loglevel", "-l")] = "INFO",
    replica: Annotated[
        int,
        typer.Option(
            min=0,
            max=15,
            help="replica number on this host: node MODALITY-N@host and metrics port "
            "port_base + 4*N + modality index (0: MODALITY@host)",
        ),
    ] = 0,
    name: Annotated[
        str, typer.Option(help="node name before @host (default: from --replica)")
    ] = "",
    models: Annotated[
        str,
        typer.Option(
            help="the models to serve, comma-separated [models.<name>] tables (default: "
            "every model of [modalities.MODALITY] model and models); each is loaded once"
        ),
    ] = "",
) -> None:
    """Run one worker process for MODALITY in the foreground (a thin wrapper over
    `celery worker -Q MODALITY`). A second worker of a modality on one host needs
    --replica 1 (its own node name and metrics port). --models picks the models it serves
    (docs/models.md, "Several models per modality")."""
    from producer.stack.local import replica_metrics_base
    from shared.errors import ModelNotFound
    from shared.model_routes import worker_models, worker_queues

    if modality not in MODALITIES:
        raise CliProblem(
            f"unknown modality {modality!r}; expected one of {', '.join(MODALITIES)}",
            ExitCode.REFUSED,
        )
    if mode not in ("batch", "baseline"):
        raise CliProblem("--mode must be batch or baseline", ExitCode.REFUSED)
    settings = cli_settings()
    window = prefetch or (
        1 if mode == "baseline" else settings.modality(modality).device.prefetch_multiplier
    )
    env = dict(os.environ, FLEET_WORKER_MODALITY=modality, FLEET_WORKER_MODE=mode)
    if replica:
        base = replica_metrics_base(settings.metrics.port_base, replica)
        env["FLEET_METRICS__PORT_BASE"] = str(base)
    for k, v in MODEL_ENV.items():
        env.setdefault(k, v)
    try:
        served = worker_models(settings, modality, models or env.get("FLEET_WORKER_MODELS", ""))
    except ModelNotFound as exc:
        raise CliProblem(exc.message, ExitCode.REFUSED) from None
    if not served:
        raise CliProblem(f"[modalities.{modality}] serves no configured model", ExitCode.REFUSED)
    env["FLEET_WORKER_MODELS"] = ",".join(m.table for m in served)
    # With a REALTIME lane the worker reads <queue>.realtime on a channel of its own
    # (workers/consumer/realtime.py); otherwise both queues share the main prefetch window.
    # Each model has its own queues; the default model's are the modality's.
    lane = mode == "batch" and settings.modality(modality).batching.realtime_lane
    queues = ",".join(worker_queues(served, realtime_apart=lane)[0])
    node = name or (f"{modality}-{replica}" if replica else modality)
    argv = [
        sys.executable, "-m", "celery", "-A", "workers.consumer.app", "worker",
        "-Q", queues, "-P", "solo", "-c", "1", "-n", f"{node}@%h",
        f"--prefetch-multiplier={window}", "-E", "--without-mingle", "--without-gossip",
        "-l", loglevel,
    ]  # fmt: skip
    os.execvpe(sys.executable, argv, env)


@app.command()
def up(
    modalities: Annotated[str, typer.Option(help="comma-separated worker modalities")] = (
        "text,image"
    ),
    replicas: Annotated[
        str,
        typer.Option(
            help="workers per modality, e.g. text=2,image=1 (modalities named here are "
            "started too); replica N is node MODALITY-N@host with its own log and metrics port"
        ),
    ] = "",
    flower: Annotated[bool, typer.Option(help="start Flower")] = True,
    gateway: Annotated[bool, typer.Option(help="start the HTTP gateway (fleet gateway)")] = True,
    ha: Annotated[
        bool,
        typer.Option(
            help="Redis high availability: a primary, a replica (port + 1) and 3 sentinels "
            "([redis] sentinels, default 127.0.0.1:26379-26381); every process follows "
            "the primary through the sentinels"
        ),
    ] = False,
) -> None:
    """Start Redis, the workers, Flower and the HTTP gateway in the background; return when
    all answer (exit 3 with the cause when one cannot start)."""
    from producer.stack.local import PortInUse, Stack, StackError, parse_replicas

    try:
        counts = parse_replicas(replicas)
    except ValueError as exc:
        raise CliProblem(str(exc), ExitCode.REFUSED) from None
    mods = _modality_list(modalities)
    settings = cli_settings()
    if ha and not settings.ha:  # the processes it starts inherit the variable
        sentinels = [f"{settings.redis.host}:{p}" for p in DEFAULT_SENTINEL_PORTS]
        os.environ["FLEET_REDIS__SENTINELS"] = json.dumps(sentinels)
        settings = cli_settings()
    stack = Stack(settings)
    running = {n for n, ok in stack.status().items() if ok and n.startswith("worker-")}
    try:
        started = stack.up(mods, flower=flower, gateway=gateway, replicas=counts)
    except PortInUse as exc:
        raise CliProblem(f"fleet up: {exc}", ExitCode.STACK) from None
    except StackError as exc:
        log = f"\n  full log: {exc.log_path}" if exc.log_path else ""
        raise CliProblem(f"fleet up failed: {exc.summary}{log}", ExitCode.STACK) from None
    _report_up(stack, started, running)


def _modality_list(modalities: str) -> list[str]:
    """``--modalities`` (comma-separated) as a list.

    Raises:
        CliProblem: an unknown modality (exit REFUSED).
    """
    mods = [m.strip() for m in modalities.split(",") if m.strip()]
    unknown = [m for m in mods if m not in MODALITIES]
    if unknown:
        raise CliProblem(
            f"unknown modality {unknown[0]!r} in --modalities; expected {', '.join(MODALITIES)}",
            ExitCode.REFUSED,
        )
    return mods


def _report_up(stack: Stack, started: list[Proc], running: set[str]) -> None:
    """What ``fleet up`` started (or that all was running), a warning when model or modality
    overrides cannot reach workers that kept running, and where the run dir and logs are."""
    settings = stack.s
    for p in started:
        typer.echo(f"started {p.name} pid={p.pid}")
    if not started:
        alive = ", ".join(n for n, ok in stack.status().items() if ok)
        typer.echo(f"nothing to start: already running: {alive}")
    overrides = sorted(
        k for k in os.environ if k.upper().startswith(("FLEET_MODELS__", "FLEET_MODALITIES__"))
    )
    if running and overrides:
        typer.echo(
            "warning: running workers keep the configuration they started with "
            f"({', '.join(sorted(running))}); {', '.join(overrides)} applies to workers "
            "started now only "
            "(to apply it: `fleet down`, then `fleet up` again)",
            err=True,
        )
    typer.echo(f"stack up; run dir {stack.dir} ({settings.run_dir_source}); logs in {stack.logs}")


@app.command()
def down() -> None:
    """Stop every process `fleet up` started in the run dir (replicas too; Redis last).
    Before Redis stops, /dev/shm is collected: the inputs of requests that are final and
    segments whose lease lapsed go (as `fleet shm gc`, renewing nothing)."""
    from producer.cli.tools import shm_at_down
    from producer.stack.local import Stack

    settings = cli_settings()
    swept: list[str | None] = []
    stopped = Stack(settings).down(before_redis=lambda: swept.append(shm_at_down(settings)))
    where = f"run dir {settings.run_dir} ({settings.run_dir_source})"
    typer.echo(
        f"stopped: {', '.join(stopped)} ({where})" if stopped else f"nothing was running ({where})"
    )
    for line in filter(None, swept):
        typer.echo(line, err=line.startswith("warning:"))


@app.command()
def status() -> None:
    """The stack's processes, Redis and live workers (replicas included) as JSON. Exit 0
    when everything started is alive and Redis answers, 3 otherwise (the cause on stderr).

    live_workers: nodes with a fresh heartbeat, less the workers of this run dir whose
    process is gone (listed under dead_workers at once, not after lease_s); live_models:
    the same per model, modality -> {model table: nodes serving it}."""
    from producer.cli.diagnose import broker_problem
    from producer.stack.local import Stack
    from shared.model_routes import catalog

    settings = cli_settings()
    stack = Stack(settings)
    procs = stack.status()
    redis_problem = broker_problem(settings, "operator")
    live: dict[str, list[str]] = {}
    models: dict[str, dict[str, list[str]]] = {}
    tenants: dict[str, dict[str, int]] = {}
    dead_nodes = stack.dead_worker_nodes()
    if redis_problem is None and settings.tenants:
        tenants = tenant_status(settings)
    if redis_problem is None:
        from producer.client import FleetClient

        client = FleetClient(settings, role="operator")
        try:
            # A local replica whose process is gone is dead now, whatever its heartbeat says
            # (it stays fresh for up to lease_s); remote workers have only the heartbeat.
            live = {
                m: [n for n in client.live_workers(m) if n not in dead_nodes] for m in MODALITIES
            }
            for m in MODALITIES:
                models[m] = {
                    s.table: [n for n in client.live_workers(m, s.table) if n not in dead_nodes]
                    for s in catalog(settings, m)
                }
                # a worker of other models only is not in the modality's own set
                live[m] = sorted({*live[m], *(n for ns in models[m].values() for n in ns)})
            models = {m: t for m, t in models.items() if live[m]}
        finally:
            client.close()
    emit(
        {
            "run_dir": str(settings.run_dir),
            "run_dir_from": settings.run_dir_source,
            "processes": procs,
            "redis": "ok" if redis_problem is None else redis_problem.splitlines()[0],
            "live_workers": {m: n for m, n in live.items() if n},
            "live_models": models,
            "dead_workers": sorted(dead_nodes),
            **({"tenants": tenants} if tenants else {}),
        }
    )
    dead = [n for n, ok in procs.items() if not ok]
    if dead:
        logs = ", ".join(f"{stack.logs / n}.log" for n in dead)
        raise CliProblem(f"down: {', '.join(dead)} (see {logs}); restart with `fleet up`")
    if redis_problem is not None:
        raise CliProblem(redis_problem)
    if not procs and not any(live.values()):
        raise CliProblem(
            f"no stack started in {settings.run_dir} ({settings.run_dir_source}) and no live "
            "worker on this Redis; start one with `make up` (or `fleet up`)"
        )


def tenant_status(settings: Settings) -> dict[str, dict[str, int]]:
    """Per ``[tenants]`` tenant: ``queued``, its messages waiting in lists of its own (fair
    share; every queue and step), and with a ``max_queued`` its ``open`` requests (queued or
    running) and the limit (``docs/tenants.md``). One round trip."""
    from shared import schema, tenant_quota, tenants
    from shared.redis_client import redis_client

    default = settings.tenancy.default_tenant
    names = sorted(settings.tenants)
    queues = [q for m in MODALITIES for q in (schema.queue_name(m), schema.realtime_queue_name(m))]
    client = redis_client(settings, "operator", socket_timeout=5.0)
    with client.pipeline(transaction=False) as pipe:
        for t in names:
            for q in queues:
                for s in schema.PRIORITY_STEPS:
                    pipe.llen(tenants.tenant_list_key(q, s, t))
            pipe.scard(tenant_quota.open_key(t))
        replies = iter(pipe.execute())
    out: dict[str, dict[str, int]] = {}
    for t in names:
        queued = sum(int(next(replies)) for _ in range(len(queues) * len(schema.PRIORITY_STEPS)))
        row = {"queued": queued} if t != default else {}
        held = int(next(replies))
        limit = settings.tenants[t].max_queued
        if limit is not None:
            row |= {"open": held, "max_queued": limit}
        out[t] = row
    return out


@app.command("flower")
def flower_info() -> None:
    """Print Flower's URL and credentials (of the running stack)."""
    from producer.stack.local import Stack

    settings = cli_settings()
    stack = Stack(settings)
    try:
        password = settings.flower_password()
    except FileNotFoundError:
        raise CliProblem(
            f"no Flower password in {settings.run_dir} ({settings.run_dir_source}): no stack "
            "was started there; start one with `make up` (or `fleet up`)"
        ) from None
    if not stack.flower_ok():
        typer.echo(f"warning: Flower does not answer at {stack.flower_url()}", err=True)
    typer.echo(f"url:      {stack.flower_url()}")
    typer.echo(f"user:     {settings.flower.user}")
    typer.echo(f"password: {password}")


@app.command("redis-url")
def redis_url_cmd(
    role: Annotated[
        str, typer.Argument(help="the Redis user: producer, operator, worker or admin")
    ] = "producer",
) -> None:
    """Print the redis:// URL, password included, that a process of ROLE connects to the
    running stack's Redis with (a Celery client of another language: producer)."""
    from shared.acl import ADMIN, ROLES

    if role not in (*ROLES, ADMIN):
        raise CliProblem(
            f"unknown Redis role {role!r}; expected one of {', '.join((*ROLES, ADMIN))}",
            ExitCode.REFUSED,
        )
    settings = cli_settings()
    try:
        url = settings.redis_url(role)
    except FileNotFoundError:
        raise CliProblem(
            f"no {settings.redis_password_file(role).name} in {settings.run_dir} "
            f"({settings.run_dir_source}): no stack was started there; start one with "
            "`make up` (or `fleet up`)"
        ) from None
    typer.echo(url)


@app.command("gateway")
def gateway_cmd(
    host: Annotated[str, typer.Option(help="bind address (default: [gateway] host)")] = "",
    port: Annotated[int, typer.Option(help="port (default: [gateway] port)")] = 0,
    workers: Annotated[int, typer.Option(help="gateway processes (uvicorn workers)")] = 1,
    token: Annotated[bool, typer.Option("--token", help="print the bearer token and exit")] = (
        False
    ),
    loglevel: Annotated[str, typer.Option("--loglevel", "-l")] = "info",
) -> None:
    """Serve the HTTP gateway (Open Inference Protocol v2 REST) in the foreground."""
    from producer.stack.local import port_in_use

    # Through the environment, so that uvicorn's worker processes load the same values.
    if host:
        os.environ["FLEET_GATEWAY__HOST"] = host
    if port:
        os.environ["FLEET_GATEWAY__PORT"] = str(port)
    settings = cli_settings()
    if token:
        typer.echo(settings.gateway_token())
        return
    g = settings.gateway
    if port_in_use(g.host, g.port):
        raise CliProblem(
            f"port {g.port} on {g.host} is already in use: choose another with --port or "
            "FLEET_GATEWAY__PORT"
        )
    from producer.gateway.server import serve

    serve(settings, workers=workers, log_level=loglevel.lower())


@app.command("exporter")
def exporter_cmd(
    host: Annotated[str, typer.Option(help="bind address (default: [metrics] exporter_host)")] = (
        ""
    ),
    port: Annotated[int, typer.Option(help="port (default: [metrics] exporter_port)")] = 0,
) -> None:
    """Serve the queue-level Prometheus series (length, demand, oldest age per queue) in the
    foreground; `fleet up` starts it on 127.0.0.1:9100 (FLEET_METRICS__EXPORTER_PORT)."""
    import logging

    from producer.ops.exporter import serve_forever
    from producer.stack.local import port_in_use

    if host:
        os.environ["FLEET_METRICS__EXPORTER_HOST"] = host
    if port:
        os.environ["FLEET_METRICS__EXPORTER_PORT"] = str(port)
    settings = cli_settings()
    m = settings.metrics
    if not m.exporter_port:
        raise CliProblem("the exporter is off ([metrics] exporter_port = 0); give --port")
    if port_in_use(m.exporter_host, m.exporter_port):
        raise CliProblem(
            f"port {m.exporter_port} on {m.exporter_host} is already in use: choose another "
            "with --port or FLEET_METRICS__EXPORTER_PORT"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    serve_forever(settings)


@app.command()
def demo() -> None:
    """The main job on a stack of its own (free ports, its own run dir under .run/demo/):
    real inputs at all priorities, bad inputs, a report; a stack you started is untouched."""
    from producer.tools.demo.run import main

    raise typer.Exit(main())
