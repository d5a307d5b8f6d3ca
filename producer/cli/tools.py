"""``fleet bench|soak|chaos|prepare|shm``: measurements, fault drills, the trace cache and
/dev/shm housekeeping."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from producer.cli.base import MODEL_ENV, CliProblem, ExitCode, app, cli_settings, emit, shm_app
from shared.settings import MODALITIES, Settings

if TYPE_CHECKING:
    from shared.transport import ShmStore
    from workers.batching.tensor_lease import Collected


@app.command()
def bench(
    workload: Annotated[
        str, typer.Argument(help="a name in configs/workloads (mixed, smoke, ...) or a path")
    ] = "mixed",
    repetitions: Annotated[int, typer.Option(help="repetitions; 0 = the workload's")] = 0,
    modes: Annotated[str, typer.Option(help="comma list of fleet, baseline, limit")] = (
        "fleet,baseline,limit"
    ),
    out_dir: Annotated[Path, typer.Option(help="where reports go")] = Path("reports/bench"),
    run_dir: Annotated[
        Path | None,
        typer.Option(help="Redis, logs, pidfiles of the run; default .run/bench/<name>-<time>"),
    ] = None,
    plot: Annotated[bool, typer.Option(help="write the PNG plot")] = True,
    interleave: Annotated[
        bool,
        typer.Option(
            "--interleave/--sequential",
            help="repetition k of every mode before k + 1 of any (order rotated each "
            "repetition), or every repetition of one mode in a row",
        ),
    ] = True,
    metrics_cost: Annotated[
        bool,
        typer.Option(
            help="instead of the modes: the fleet with metrics and tracing (1 %) on vs off, "
            "interleaved; --modes and --repetitions do not apply (producer/tools/bench/README.md)"
        ),
    ] = False,
    cost_rounds: Annotated[int, typer.Option(help="--metrics-cost: on/off pairs")] = 4,
    cost_round_s: Annotated[
        float, typer.Option(help="--metrics-cost: seconds of load per run; 0 = the workload's")
    ] = 0.0,
    list_workloads: Annotated[bool, typer.Option("--list", help="list workloads and exit")] = (
        False
    ),
) -> None:
    """Replay WORKLOAD against the fleet, a plain-Celery baseline and the in-process limit."""
    from producer.tools.bench.main import main, names

    if list_workloads:
        typer.echo("\n".join(names()))
        return
    cost = None
    if metrics_cost:
        from producer.tools.bench.metricscost import CostOptions

        if cost_rounds < 1 or cost_round_s < 0:
            raise typer.BadParameter("--cost-rounds must be >= 1 and --cost-round-s >= 0")
        cost = CostOptions(cost_rounds, cost_round_s or None)
    raise typer.Exit(
        main(workload, repetitions, modes, out_dir, plot, run_dir, cost, interleave=interleave)
    )


@app.command()
def soak(
    requests: Annotated[int, typer.Option(help="requests after the warmup")] = 10_000,
    warmup: Annotated[int, typer.Option(help="warmup requests before the first RSS reading")] = (
        500
    ),
    wave: Annotated[int, typer.Option(help="requests per wave (submit, then wait for all)")] = (
        500
    ),
    out: Annotated[Path, typer.Option(help="the JSON report")] = Path("reports/soak.json"),
) -> None:
    """Send REQUESTS real sentences through a warmed text worker; report its memory growth.

    Runs a stack of its own (Redis + one text worker, free ports, a temporary run dir).
    """
    from producer.tools.soak import SoakOptions, main

    raise typer.Exit(main(SoakOptions(requests=requests, warmup=warmup, wave=wave, out=out)))


@app.command()
def chaos(
    short: Annotated[bool, typer.Option(help="the short scenarios, text workers only (CI)")] = (
        False
    ),
    scenarios: Annotated[str, typer.Option(help="comma list of scenario names (default: all)")] = (
        ""
    ),
    video: Annotated[bool, typer.Option(help="start a video worker and run video scenarios")] = (
        True
    ),
    file: Annotated[Path, typer.Option(help="the scenario file")] = Path("configs/chaos.toml"),
    out: Annotated[Path, typer.Option(help="the JSON report")] = Path("reports/chaos.json"),
) -> None:
    """Inject faults into a real stack under load; report lost / duplicated / recovery.

    Exit 0 when every scenario meets the goal (0 lost, 0 duplicated final results, every
    request final within 15 s of the fault's end not counting worker restarts, no worker
    exit), 1 otherwise, 2 on a bad scenario file.
    """
    from producer.tools.chaos.main import main

    raise typer.Exit(main(file, [n for n in scenarios.split(",") if n], short, video, out))


@app.command()
def prepare(
    modalities: Annotated[
        list[str] | None, typer.Argument(help="text, image, video, xmodal (default: all)")
    ] = None,
) -> None:
    """Trace each modality's model and store it in the trace cache, so that a worker's first
    start on this host (or in this image: the Dockerfile runs it) loads the stored trace.
    One JSON line per modality: its model, device, trace_cache (stored, hit or off), load_s.
    """
    for k, v in MODEL_ENV.items():
        os.environ.setdefault(k, v)  # before transformers is imported
    from workers.models.prepare import prepare as fill

    unknown = [m for m in modalities or [] if m not in MODALITIES]
    if unknown:
        raise CliProblem(
            f"unknown modality {unknown[0]!r}; expected one of {', '.join(MODALITIES)}",
            ExitCode.REFUSED,
        )
    for line in fill(cli_settings(), modalities or None):
        emit(line)


@shm_app.command("ls")
def shm_ls() -> None:
    """List segments: id, size, owner, age, expiry, whether the owner is alive (or detached:
    kept for its TTL only), and the request a video input was sent for (its TTL is renewed
    while that request may run)."""
    from shared.transport import store_from_settings

    store = store_from_settings(cli_settings())
    now = time.time()
    segs = store.ls()
    for seg in segs:
        # A detached segment (pid 0) is tied to its TTL only: no owner to be alive or dead.
        owner_state = "detached" if seg.pid == 0 else f"owner_alive={seg.alive_owner}"
        request = f"  request={seg.request}" if seg.request else ""
        typer.echo(
            f"{seg.id}  {seg.nbytes:>12} B  owner={seg.owner}  age={now - seg.created_at:.0f}s"
            f"  expires_in={seg.expires_at - now:.0f}s  {owner_state}{request}"
        )
    pooled = store.pool_bytes()
    typer.echo(
        f"{len(segs)} segments, {store.used_bytes()} bytes in {store.root} (of which "
        f"{pooled} bytes: released files kept for reuse, [transport] recycle_bytes)"
    )


@shm_app.command("gc")
def shm_gc() -> None:
    """Remove expired segments, the inputs of requests that are final (even before their
    lease ends), segments whose owner process is gone, and released files kept for reuse
    but unused for 30 s; then say what was kept and why. Like the workers' janitor, it first
    renews the video inputs of requests Redis says may still run; when Redis cannot tell (the
    stack is down), it renews nothing and removes only what lapsed."""
    from shared.transport import store_from_settings

    settings = cli_settings()
    store = store_from_settings(settings)
    done = collect_shm(settings, store, renew=True)
    removed = done.removed
    typer.echo(f"removed {len(removed)} segment(s)" + (": " + " ".join(removed) if removed else ""))
    if done.finished:
        typer.echo(f"of which {len(done.finished)} the inputs of requests that are final")
    if done.cause is not None:
        typer.echo(
            f"Redis could not tell which requests are final ({done.cause}): their inputs stay "
            "until their leases end (lapsed ones were removed); with the stack up, "
            "`fleet shm gc` removes those of finished requests at once"
        )
    now = time.time()
    for seg in store.ls():
        left = f"expires in {seg.expires_at - now:.0f} s"
        if seg.request:
            why = (
                f"the input of request {seg.request}: renewed by the workers' janitors while "
                f"that request may still run, at most [transport] max_ref_lifetime_s after it "
                f"was written; {left} unless renewed"
            )
        elif seg.pid == 0:
            why = (
                "detached (a worker's output not read yet, or a tensor put without a "
                f"request): kept until its TTL, {left}"
            )
        else:
            why = f"its owner {seg.owner} is alive: kept until it releases it or {left}"
        typer.echo(f"kept {seg.id} ({seg.nbytes} B): {why}")
    pooled = store.pool_bytes()
    if pooled:
        typer.echo(
            f"kept {pooled} B of released files for reuse ([transport] recycle_bytes): "
            "removed after 30 s unused"
        )


def collect_shm(settings: Settings, store: ShmStore, renew: bool) -> Collected:
    """An operator's collection of ``store`` as Redis's ``operator`` user (see
    ``SegmentRenewer.collect``): the inputs of final requests and lapsed leases go; with
    ``renew``, due inputs of requests Redis says are not final are renewed first.

    Raises:
        TransportError: the store's directory cannot be listed.
    """
    from workers.batching.tensor_lease import SegmentRenewer

    renewer = SegmentRenewer(settings, settings.transport.janitor_interval_s, role="operator")
    try:
        return renewer.collect(store, renew=renew)
    finally:
        renewer.close()


def shm_at_down(settings: Settings) -> str | None:
    """``fleet down``'s collection of the stack's /dev/shm root, run after the other
    processes stopped and before Redis does (it alone can tell which requests are final):
    the inputs of final requests and lapsed leases go, nothing is renewed. Returns the line
    to print, or None (no root: nothing was ever written, or the host shares no /dev/shm).
    """
    from shared.transport import default_root, store_from_settings

    t = settings.transport
    root = t.shm_root or default_root()
    if not t.shared_host or not root.is_dir():
        return None
    try:
        store = store_from_settings(settings)
        done = collect_shm(settings, store, renew=False)
        left = len(store.ls())
    except Exception as exc:  # `fleet down` goes on to stop Redis whatever happened here
        return f"warning: could not collect {root}: {exc}; run `fleet shm gc` later"
    note = "" if done.cause is None else f"; Redis could not tell which are final: {done.cause}"
    return (
        f"shm: removed {len(done.removed)} file(s) from {root} ({len(done.finished)} the "
        f"inputs of final requests), {left} segment(s) left (`fleet shm ls`){note}"
    )
