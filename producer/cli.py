"""The ``fleet`` command line: run workers, manage the local stack, submit requests.

Exit codes: 0 success; 2 the request was refused or failed with a fleet error (the error is
printed to stdout as JSON ``{"error": {"code", "message", "type"}}``); 1 anything else.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from shared.errors import FleetError
from shared.keys import realtime_queue_name
from shared.settings import MODALITIES, load_settings

app = typer.Typer(help="Multimodal inference worker fleet on Celery + Redis.", no_args_is_help=True)
submit_app = typer.Typer(help="Submit one request and print its result as JSON.")
app.add_typer(submit_app, name="submit")
shm_app = typer.Typer(help="Inspect and clean the /dev/shm tensor segments of this host.")
app.add_typer(shm_app, name="shm")


def _print(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=None, separators=(",", ":")))


def _fail(exc: FleetError, task_id: str | None = None) -> None:
    _print({**({"id": task_id} if task_id else {}), "error": exc.to_dict()})
    raise typer.Exit(2)


def _require_file(path: Path) -> None:
    """A readable regular file, else a JSON ``INVALID_INPUT`` error and exit 2."""
    from shared.errors import InvalidInput

    if not path.is_file():
        what = "a directory" if path.is_dir() else "not a regular file or does not exist"
        _fail(InvalidInput(f"cannot read {str(path)!r}: {what}"))


def _broker_errors() -> tuple[type[BaseException], ...]:
    from kombu.exceptions import OperationalError
    from redis.exceptions import ConnectionError as RedisConnectionError

    return (OperationalError, RedisConnectionError, ConnectionError)


BROKER_ERRORS = _broker_errors()


def _broker_down(exc: BaseException) -> None:
    """The broker cannot be reached: one clear line instead of a traceback; exit 1."""
    settings = load_settings()
    typer.echo(
        f"cannot reach Redis at {settings.redis.host}:{settings.redis.port} "
        f"({type(exc).__name__}); is the stack up? (`make up`)",
        err=True,
    )
    raise typer.Exit(1)


# -- workers -------------------------------------------------------------------------------
@app.command()
def worker(
    modality: Annotated[str, typer.Argument(help="text, image, video or xmodal")],
    mode: Annotated[str, typer.Option(help="batch (the fleet) or baseline (plain Celery)")] = (
        "batch"
    ),
    prefetch: Annotated[int, typer.Option(help="prefetch window; 0 = from config")] = 0,
    loglevel: Annotated[str, typer.Option("--loglevel", "-l")] = "INFO",
    name: Annotated[
        str, typer.Option(help="node name before @host (default: MODALITY); one per process")
    ] = "",
) -> None:
    """Run one worker process for MODALITY (a thin wrapper over `celery worker -Q MODALITY`)."""
    if modality not in MODALITIES:
        typer.echo(f"unknown modality {modality!r}; expected one of {MODALITIES}", err=True)
        raise typer.Exit(1)
    if mode not in ("batch", "baseline"):
        typer.echo("--mode must be batch or baseline", err=True)
        raise typer.Exit(1)
    settings = load_settings()
    window = prefetch or (
        1 if mode == "baseline" else settings.modality(modality).device.prefetch_multiplier
    )
    env = dict(os.environ, FLEET_WORKER_MODALITY=modality, FLEET_WORKER_MODE=mode)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # With a REALTIME lane the worker reads <modality>.realtime on a channel of its own
    # (workers/realtime.py); otherwise both queues share the main prefetch window.
    lane = mode == "batch" and settings.modality(modality).batching.realtime_lane
    queues = modality if lane else f"{modality},{realtime_queue_name(modality)}"
    argv = [
        sys.executable, "-m", "celery", "-A", "workers.app", "worker",
        "-Q", queues, "-P", "solo", "-c", "1", "-n", f"{name or modality}@%h",
        f"--prefetch-multiplier={window}", "-E", "--without-mingle", "--without-gossip",
        "-l", loglevel,
    ]  # fmt: skip
    os.execvpe(sys.executable, argv, env)


# -- local stack ---------------------------------------------------------------------------
@app.command()
def up(
    modalities: Annotated[str, typer.Option(help="comma-separated worker modalities")] = (
        "text,image"
    ),
    flower: Annotated[bool, typer.Option(help="start Flower")] = True,
    gateway: Annotated[bool, typer.Option(help="start the HTTP gateway (fleet gateway)")] = True,
) -> None:
    """Start Redis, the workers, Flower and the HTTP gateway in the background; return when
    all answer."""
    from producer.stack import Stack, StackError

    stack = Stack(load_settings())
    try:
        started = stack.up([m for m in modalities.split(",") if m], flower=flower, gateway=gateway)
    except StackError as exc:
        typer.echo(f"fleet up failed: {exc}", err=True)
        raise typer.Exit(1) from None
    for p in started:
        typer.echo(f"started {p.name} pid={p.pid}")
    typer.echo(f"stack up; run dir {stack.dir}")


@app.command()
def down() -> None:
    """Stop every process `fleet up` started (Redis last)."""
    from producer.stack import Stack

    stopped = Stack(load_settings()).down()
    typer.echo("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))


@app.command()
def status() -> None:
    """Show which stack processes are alive."""
    from producer.stack import Stack

    _print(Stack(load_settings()).status())


@app.command("flower")
def flower_info() -> None:
    """Print Flower's URL and credentials."""
    from producer.stack import Stack

    settings = load_settings()
    stack = Stack(settings)
    typer.echo(f"url:      {stack.flower_url()}")
    typer.echo(f"user:     {settings.flower.user}")
    typer.echo(f"password: {settings.flower_password()}")


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
    # Through the environment, so that uvicorn's worker processes load the same values.
    if host:
        os.environ["FLEET_GATEWAY__HOST"] = host
    if port:
        os.environ["FLEET_GATEWAY__PORT"] = str(port)
    settings = load_settings()
    if token:
        typer.echo(settings.gateway_token())
        return
    from producer.gateway.server import serve

    serve(settings, workers=workers, log_level=loglevel.lower())


# -- submitting ----------------------------------------------------------------------------
def _submit(
    modality: str, inputs: dict[str, Any], priority: str, timeout_s: float | None, wait_s: float
) -> None:
    """Submit plain JSON inputs, wait, and print the result (or the error) as JSON."""
    _submit_resolved(modality, lambda _client: inputs, priority, timeout_s, wait_s, full=True)


PriorityOpt = Annotated[str, typer.Option(help="realtime, high, normal or bulk")]
TimeoutOpt = Annotated[float | None, typer.Option(help="deadline in seconds from now")]
WaitOpt = Annotated[float, typer.Option(help="seconds to wait for the result; 0 = don't")]


@submit_app.command("text")
def submit_text(
    text: Annotated[str, typer.Option(help="the text to embed")],
    priority: PriorityOpt = "normal",
    timeout_s: TimeoutOpt = None,
    wait_s: WaitOpt = 30.0,
) -> None:
    """Embed a text with all-MiniLM-L6-v2 (384 floats, unit norm)."""
    _submit("text", {"text": text}, priority, timeout_s, wait_s)


@submit_app.command("image")
def submit_image(
    file: Annotated[Path, typer.Option(help="an image file (JPEG, PNG, WebP, ...)")],
    priority: PriorityOpt = "normal",
    timeout_s: TimeoutOpt = None,
    wait_s: WaitOpt = 30.0,
) -> None:
    """Embed an image with the configured vision model."""
    from producer.client import image_inputs

    _require_file(file)
    _submit("image", image_inputs(file), priority, timeout_s, wait_s)


def _submit_resolved(
    modality: str,
    make_inputs: Any,
    priority: str,
    timeout_s: float | None,
    wait_s: float,
    full: bool,
) -> None:
    """Submit, wait, resolve tensor outputs (TensorRefs) and print the result as JSON.

    Arrays are printed as ``{"shape", "dtype"}`` summaries, or as nested lists with ``full``.
    Input segments this command put in /dev/shm are released once the outcome is in (or
    left to their TTL when not waiting).
    """
    from producer.client import FleetClient, ResultHandle

    handle: ResultHandle | None = None
    client: FleetClient | None = None
    try:
        client = FleetClient.from_settings()
        inputs = make_inputs(client)
        try:
            handle = client.submit(modality, inputs, priority=priority, timeout_s=timeout_s)
        except BaseException:
            client.release_inputs(inputs)
            raise
        if wait_s <= 0:
            _print({"id": handle.id})
            return
        result = handle.get(timeout_s=wait_s)
    except FleetError as exc:
        _fail(exc, handle.id if handle is not None else None)
        return
    except BROKER_ERRORS as exc:
        _broker_down(exc)
        return
    except TimeoutError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    finally:
        if client is not None:
            client.close()  # a one-shot process: no released file kept for reuse
    _print({"id": handle.id, "result": _jsonable(result, full)})


def _jsonable(obj: Any, full: bool) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v, full) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_jsonable(v, full) for v in obj]
    if hasattr(obj, "tolist") and hasattr(obj, "shape"):  # a numpy array
        return obj.tolist() if full else {"shape": list(obj.shape), "dtype": str(obj.dtype)}
    return obj


FullOpt = Annotated[
    bool,
    typer.Option(
        "--full",
        help="print tensor outputs (e.g. frame_embeddings) in full, not just their shapes "
        "(embeddings sent as JSON lists, e.g. clip_embedding, always print in full)",
    ),
]


@submit_app.command("video")
def submit_video(
    file: Annotated[Path, typer.Option(help="a video file (MP4/MOV, MKV/WebM, AVI, MPEG-TS)")],
    priority: PriorityOpt = "normal",
    timeout_s: TimeoutOpt = None,
    wait_s: WaitOpt = 120.0,
    full: FullOpt = False,
) -> None:
    """Embed a video's sampled frames: per-frame embeddings and a clip embedding.

    Files above 32 KiB travel through /dev/shm (the message carries a TensorRef).
    """
    _require_file(file)
    _submit_resolved("video", lambda c: c.video_inputs(file), priority, timeout_s, wait_s, full)


@submit_app.command("xmodal")
def submit_xmodal(
    image: Annotated[Path, typer.Option(help="an image file")],
    text: Annotated[list[str], typer.Option(help="a text to score; repeat for several (1-16)")],
    priority: PriorityOpt = "normal",
    timeout_s: TimeoutOpt = None,
    wait_s: WaitOpt = 30.0,
    full: FullOpt = False,
) -> None:
    """Score an image against texts with the cross-modal dual encoder (CLIP-style).

    With the default random projection weights the scores are not semantically meaningful.
    """
    from producer.client import xmodal_inputs

    _require_file(image)
    _submit_resolved(
        "xmodal", lambda c: xmodal_inputs(image, text), priority, timeout_s, wait_s, full
    )


@submit_app.command("raw")
def submit_raw(
    modality: Annotated[str, typer.Argument()],
    inputs: Annotated[str, typer.Option(help="the inputs as a JSON object")],
    priority: PriorityOpt = "normal",
    timeout_s: TimeoutOpt = None,
    wait_s: WaitOpt = 30.0,
) -> None:
    """Submit any modality with inputs given as JSON."""
    from shared.errors import InvalidInput

    try:
        parsed = json.loads(inputs)
    except json.JSONDecodeError as exc:
        _fail(InvalidInput(f"--inputs is not JSON: {exc}"))
        return
    _submit(modality, parsed, priority, timeout_s, wait_s)


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
    """List segments: id, size, owner, age, expiry, whether the owner is alive (or
    ``detached``: kept for its TTL only)."""
    import time

    from shared.transport import store_from_settings

    store = store_from_settings(load_settings())
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
    """Remove expired segments, those whose owner process is gone, and released files kept
    for reuse that were not reused for 30 s."""
    from shared.transport import store_from_settings

    removed = store_from_settings(load_settings()).gc()
    typer.echo(f"removed {len(removed)}: " + " ".join(removed))


@app.command()
def demo() -> None:
    """The main job: bring the stack up, run real inputs, report, bring it down."""
    from producer.demo import main

    raise typer.Exit(main())


if __name__ == "__main__":
    app()
