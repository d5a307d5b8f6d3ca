"""``fleet bench|soak|chaos|shm``: measurements, fault drills and /dev/shm housekeeping."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from producer.cli.base import app, cli_settings, shm_app


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
    list_workloads: Annotated[bool, typer.Option("--list", help="list workloads and exit")] = (
        False
    ),
) -> None:
    """Replay WORKLOAD against the fleet, a plain-Celery baseline and the in-process limit."""
    from producer.bench.main import main, names

    if list_workloads:
        typer.echo("\n".join(names()))
        return
    raise typer.Exit(main(workload, repetitions, modes, out_dir, plot, run_dir))


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
    from producer.soak import SoakOptions, main

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
    from producer.chaos.main import main

    raise typer.Exit(main(file, [n for n in scenarios.split(",") if n], short, video, out))


@shm_app.command("ls")
def shm_ls() -> None:
    """List segments: id, size, owner, age, expiry, and whether the owner is alive (or
    detached: kept for its TTL only)."""
    from shared.transport import store_from_settings

    store = store_from_settings(cli_settings())
    now = time.time()
    segs = store.ls()
    for seg in segs:
        # A detached segment (pid 0) is tied to its TTL only: no owner to be alive or dead.
        owner_state = "detached" if seg.pid == 0 else f"owner_alive={seg.alive_owner}"
        typer.echo(
            f"{seg.id}  {seg.nbytes:>12} B  owner={seg.owner}  age={now - seg.created_at:.0f}s"
            f"  expires_in={seg.expires_at - now:.0f}s  {owner_state}"
        )
    pooled = store.pool_bytes()
    typer.echo(
        f"{len(segs)} segments, {store.used_bytes()} bytes in {store.root} (of which "
        f"{pooled} bytes: released files kept for reuse, [transport] recycle_bytes)"
    )


@shm_app.command("gc")
def shm_gc() -> None:
    """Remove expired segments, segments whose owner process is gone, and released files
    kept for reuse but unused for 30 s; then say what was kept and why."""
    from shared.transport import store_from_settings

    store = store_from_settings(cli_settings())
    removed = store.gc()
    typer.echo(f"removed {len(removed)} segment(s)" + (": " + " ".join(removed) if removed else ""))
    now = time.time()
    for seg in store.ls():
        left = f"expires in {seg.expires_at - now:.0f} s"
        if seg.pid == 0:
            why = (
                "detached (a video input sent without waiting, or a worker's output not read "
                f"yet): kept until its TTL, {left}"
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
