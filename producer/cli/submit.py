"""``fleet submit text|image|video|xmodal|raw``: one request, its result as JSON.

Before anything is sent: the input checks a producer can make (empty or missing files,
``[limits]`` sizes), Redis is usable (else exit 3 with the cause) and a live worker
consumes the modality's queue (else, when waiting, ``NO_READY_WORKER`` and exit 3 unless
``--queue-anyway``; without waiting a warning). Nothing is put in /dev/shm for a request
that is refused.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from producer.cli.base import (
    WaitTimeout,
    check_seconds,
    cli_settings,
    emit,
    fail,
    submit_app,
)
from producer.cli.output import jsonable
from shared import tenants
from shared.errors import FleetError, InvalidInput, NoReadyWorker, PayloadTooLarge
from shared.settings import MODALITIES, Settings

PriorityOpt = Annotated[str, typer.Option(help="realtime, high, normal or bulk")]
TimeoutOpt = Annotated[float | None, typer.Option(help="deadline in seconds from now")]
TenantOpt = Annotated[
    str | None,
    typer.Option(
        "--tenant",
        help="who the request is for (docs/tenants.md); default: the default tenant",
        show_default=False,
    ),
]
WaitOpt = Annotated[
    float, typer.Option(help="seconds to wait for the result; 0 = print the id and return")
]
QueueAnywayOpt = Annotated[
    bool,
    typer.Option(
        "--queue-anyway",
        help="queue the request even when no live worker consumes the modality's queue",
    ),
]
ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="the model to run it (a served name or [models.<name>] table); default: the "
        "modality's default model",
        show_default=False,
    ),
]
VersionOpt = Annotated[
    str | None,
    typer.Option(
        "--model-version", help="the model's version (default: its latest)", show_default=False
    ),
]
FullOpt = Annotated[
    bool,
    typer.Option(
        "--full",
        help="print tensor outputs (e.g. frame_embeddings) in full, not just their shapes "
        "(embeddings sent as JSON lists, e.g. clip_embedding, always print in full)",
    ),
]


# -- checks at the producer ------------------------------------------------------------------
def check_file(path: Path, what: str = "file") -> None:
    """A readable, non-empty regular file.

    Raises:
        InvalidInput: missing, a directory, or empty (0 bytes).
    """
    if not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file or does not exist"
        raise InvalidInput(f"cannot read {what} {str(path)!r}: {kind}")
    if path.stat().st_size == 0:
        raise InvalidInput(f"{what} {str(path)!r} is empty (0 bytes): nothing to embed")


def check_inline_file(path: Path, settings: Settings, what: str) -> None:
    """``check_file``, and its base64 must fit ``[limits] max_inline_bytes``.

    Raises:
        InvalidInput, PayloadTooLarge.
    """
    check_file(path, what)
    size = path.stat().st_size
    encoded = 4 * ((size + 2) // 3)
    limit = settings.limits.max_inline_bytes
    if encoded > limit:
        raise PayloadTooLarge(
            f"{what} {str(path)!r} is {size} bytes ({encoded} as base64); inline inputs are "
            f"limited to {limit} bytes ([limits] max_inline_bytes)"
        )


def check_text(text: str, settings: Settings, what: str = "text") -> None:
    """Not blank and at most ``[limits] max_text_chars`` characters (the worker's limits).

    Raises:
        InvalidInput, PayloadTooLarge.
    """
    if not text.strip():
        raise InvalidInput(f"{what} is empty or only whitespace")
    limit = settings.limits.max_text_chars
    if len(text) > limit:
        raise PayloadTooLarge(
            f"{what} has {len(text)} characters; the limit is {limit} ([limits] max_text_chars)"
        )


# -- submitting ------------------------------------------------------------------------------
def run_submit(
    modality: str,
    make_inputs: Callable[[Any], dict[str, Any]],
    *,
    priority: str,
    timeout_s: float | None,
    wait_s: float,
    tenant: str | None = None,
    full: bool = True,
    queue_anyway: bool = False,
    precheck: Callable[[Settings], None] | None = None,
    model: str | None = None,
    version: str | None = None,
) -> None:
    """Check, submit, wait, resolve tensor outputs and print the outcome as JSON.

    Arrays print as ``{"shape", "dtype"}`` summaries, or as nested lists with ``full``.
    Input segments this command put in /dev/shm are released once the outcome is in (or
    left to their TTL when not waiting).

    Raises:
        typer.Exit: with the exit code of the outcome (see ``producer.cli.base``).
        CliProblem: the stack is not usable (exit 3), or ``wait_s`` is negative (exit 2).
    """
    from producer.cli.diagnose import broker_errors, broker_lost, require_broker
    from producer.client import FleetClient, ResultHandle

    check_seconds("--wait-s", wait_s)
    settings = cli_settings()
    handle: ResultHandle | None = None
    client: FleetClient | None = None
    try:
        if precheck is not None:
            precheck(settings)
        require_broker(settings)
        client = FleetClient(settings)
        # modality, priority, timeout and model (MODEL_NOT_FOUND, exit 2)
        env = client.envelope(modality, {}, priority, timeout_s, model, version)
        if tenant is not None:
            tenants.check_name(tenant)
        if modality in MODALITIES:
            waiting = wait_s > 0 and not queue_anyway  # no model named: the modality's queue
            _check_live_worker(settings, client, modality, waiting, env.model)
        inputs = make_inputs(client)
        try:
            handle = client.submit(
                modality,
                inputs,
                priority=priority,
                timeout_s=timeout_s,
                model=model,
                version=version,
                tenant=tenant,
            )
        except BaseException:
            client.release_inputs(inputs)
            raise
        if wait_s <= 0:
            emit({"id": handle.id, "state": "PENDING"})
            typer.echo(
                f"queued; read the result with `fleet result {handle.id}` "
                f"or follow it with `fleet watch {handle.id}`",
                err=True,
            )
            return
        result = _wait(handle, wait_s)
    except broker_errors() as exc:  # before FleetError: BrokerUnavailable is one (exit 3)
        raise broker_lost(settings, exc) from None
    except FleetError as exc:
        fail(exc, handle.id if handle is not None else None)
    finally:
        if client is not None:
            client.close()  # a one-shot process: no released file kept for reuse
    emit({"id": handle.id, "result": jsonable(result, full)})


def _check_live_worker(
    settings: Settings, client: Any, modality: str, waiting: bool, model: str | None = None
) -> None:
    """No live worker for ``modality``'s ``model`` (a table; ``None``: one consuming the
    modality's own queue, its default model's): fail when the caller would wait for it, else
    warn on stderr that the request stays queued.

    Raises:
        typer.Exit: no ready worker and ``waiting``.
    """
    from producer.cli.diagnose import live_nodes, live_summary, no_worker_message

    if live_nodes(settings, client, modality, model):
        return
    msg = no_worker_message(modality, live_summary(settings, client), not waiting, model)
    if waiting:
        fail(NoReadyWorker(msg.splitlines()[0]), hint=msg.splitlines()[1].strip())
    typer.echo(f"warning: {msg}", err=True)


def _wait(handle: Any, wait_s: float) -> Any:
    """The result within ``wait_s`` seconds.

    Raises:
        FleetError: the request failed.
        typer.Exit: no final result in time.
    """
    try:
        return handle.get(timeout_s=wait_s)
    except TimeoutError:
        state = handle.state()
        fail(
            WaitTimeout(f"no final result within {wait_s:g} s; its state is {state}"),
            handle.id,
            hint=f"it may still run: `fleet result {handle.id}` or `fleet watch {handle.id}`",
        )


def read_text_file(path: Path, settings: Settings) -> str:
    """The UTF-8 text of ``path`` (``-``: standard input), read no further than a text over
    ``[limits] max_text_chars`` needs (4 bytes a character at most).

    Raises:
        InvalidInput: a missing or empty file, or bytes that are not UTF-8.
        PayloadTooLarge: more than ``max_text_chars`` characters.
    """
    limit = settings.limits.max_text_chars
    most = 4 * limit  # a longer file holds more than `limit` characters
    where = "standard input" if str(path) == "-" else f"text file {str(path)!r}"
    if str(path) == "-":
        data = sys.stdin.buffer.read(most + 1)
    else:
        check_file(path, "text file")
        with path.open("rb") as f:
            data = f.read(most + 1)
    if len(data) > most:
        raise PayloadTooLarge(
            f"{where} holds more than {limit} characters (over {most} bytes); the limit is "
            f"{limit} ([limits] max_text_chars)"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        why = f"{exc.reason} at byte {exc.start}"
        raise InvalidInput(f"{where} is not UTF-8 text ({why})") from None
    check_text(text, settings, where)
    return text


def one_text(text: str | None, text_file: Path | None, settings: Settings) -> str:
    """The text to embed: ``--text`` or the content of ``--text-file``, exactly one of them.

    Raises:
        InvalidInput: both or neither given, or a bad file (:func:`read_text_file`).
        PayloadTooLarge: the text is over ``[limits] max_text_chars``.
    """
    if (text is None) == (text_file is None):
        given = "both --text and --text-file" if text is not None else "neither"
        raise InvalidInput(
            f"give the text with --text TEXT or --text-file PATH (- for standard input), "
            f"exactly one of them; got {given}"
        )
    if text_file is not None:
        return read_text_file(text_file, settings)
    check_text(text or "", settings)
    return text or ""


@submit_app.command("text")
def submit_text(
    text: Annotated[
        str | None, typer.Option(help="the text to embed (or --text-file)", show_default=False)
    ] = None,
    text_file: Annotated[
        Path | None,
        typer.Option(
            "--text-file",
            help="read the text to embed from this UTF-8 file, - for standard input (a text "
            "longer than the shell's argument limit); instead of --text",
            show_default=False,
        ),
    ] = None,
    priority: PriorityOpt = "normal",
    timeout_s: TimeoutOpt = None,
    tenant: TenantOpt = None,
    wait_s: WaitOpt = 30.0,
    queue_anyway: QueueAnywayOpt = False,
    model: ModelOpt = None,
    model_version: VersionOpt = None,
) -> None:
    """Embed a text with the text modality's model (all-MiniLM-L6-v2 by default: 384 floats,
    unit norm; --model picks another): --text TEXT, or --text-file PATH (- reads standard
    input)."""
    read: list[str] = []  # the text, once the precheck read it (before anything is sent)

    def precheck(settings: Settings) -> None:
        read.append(one_text(text, text_file, settings))

    run_submit(
        "text",
        lambda _c: {"text": read[0]},
        priority=priority,
        timeout_s=timeout_s,
        tenant=tenant,
        wait_s=wait_s,
        queue_anyway=queue_anyway,
        precheck=precheck,
        model=model,
        version=model_version,
    )


TopKOpt = Annotated[
    int | None,
    typer.Option(
        "--top-k",
        min=0,
        max=1000,
        help="how many ImageNet labels to return, best first (default: the model's top_k, 5)",
    ),
]


def _with_top_k(inputs: dict[str, Any], top_k: int | None) -> dict[str, Any]:
    return inputs if top_k is None else {**inputs, "top_k": top_k}


@submit_app.command("image")
def submit_image(
    file: Annotated[Path, typer.Option(help="an image file (JPEG, PNG, WebP, ...)")],
    top_k: TopKOpt = None,
    priority: PriorityOpt = "normal",
    timeout_s: TimeoutOpt = None,
    tenant: TenantOpt = None,
    wait_s: WaitOpt = 30.0,
    queue_anyway: QueueAnywayOpt = False,
    model: ModelOpt = None,
    model_version: VersionOpt = None,
) -> None:
    """Embed and label an image with the configured vision model (EfficientNet-Lite0: a
    1,280-d embedding and its top-k ImageNet labels)."""
    from producer.client import image_inputs

    run_submit(
        "image",
        lambda _c: _with_top_k(image_inputs(file), top_k),
        priority=priority,
        timeout_s=timeout_s,
        tenant=tenant,
        wait_s=wait_s,
        queue_anyway=queue_anyway,
        precheck=lambda s: check_inline_file(file, s, "image file"),
        model=model,
        version=model_version,
    )


@submit_app.command("video")
def submit_video(
    file: Annotated[Path, typer.Option(help="a video file (MP4/MOV, MKV/WebM, AVI, MPEG-TS)")],
    top_k: TopKOpt = None,
    priority: PriorityOpt = "normal",
    timeout_s: TimeoutOpt = None,
    tenant: TenantOpt = None,
    wait_s: WaitOpt = 120.0,
    full: FullOpt = False,
    queue_anyway: QueueAnywayOpt = False,
    model: ModelOpt = None,
    model_version: VersionOpt = None,
) -> None:
    """Embed a video's sampled frames: per-frame embeddings, a clip embedding and the clip's
    top-k labels.

    Files up to 32 KiB travel inline (base64); larger ones through /dev/shm, the message
    carrying a TensorRef (the client's fixed video threshold, which keeps a task message
    under 64 KB).
    """
    run_submit(
        "video",
        lambda c: _with_top_k(c.video_inputs(file), top_k),
        priority=priority,
        timeout_s=timeout_s,
        tenant=tenant,
        wait_s=wait_s,
        full=full,
        queue_anyway=queue_anyway,
        precheck=lambda _s: check_file(file, "video file"),
        model=model,
        version=model_version,
    )


@submit_app.command("xmodal")
def submit_xmodal(
    image: Annotated[Path, typer.Option(help="an image file")],
    text: Annotated[list[str], typer.Option(help="a text to score; repeat for several (1-16)")],
    top_k: TopKOpt = None,
    priority: PriorityOpt = "normal",
    timeout_s: TimeoutOpt = None,
    tenant: TenantOpt = None,
    wait_s: WaitOpt = 30.0,
    full: FullOpt = False,
    queue_anyway: QueueAnywayOpt = False,
    model: ModelOpt = None,
    model_version: VersionOpt = None,
) -> None:
    """Score an image against texts with the xmodal modality's model ("scores" in the order
    of the texts).

    The default is ConSE (ImageNet classes of the image, embedded as text): it knows only
    ImageNet concepts (docs/models.md, ConSE); ``--top-k`` is how many of the image's labels
    it returns (a model without labels refuses it).
    """
    from producer.client import xmodal_inputs

    def precheck(s: Settings) -> None:
        check_inline_file(image, s, "image file")
        if not 1 <= len(text) <= 16:
            raise InvalidInput(f"give 1 to 16 texts (--text), not {len(text)}")
        for i, t in enumerate(text):
            check_text(t, s, f"--text #{i + 1}")

    run_submit(
        "xmodal",
        lambda _c: _with_top_k(xmodal_inputs(image, text), top_k),
        priority=priority,
        timeout_s=timeout_s,
        tenant=tenant,
        wait_s=wait_s,
        full=full,
        queue_anyway=queue_anyway,
        precheck=precheck,
        model=model,
        version=model_version,
    )


@submit_app.command("raw")
def submit_raw(
    modality: Annotated[str, typer.Argument()],
    inputs: Annotated[str, typer.Option(help="the inputs as a JSON object")],
    priority: PriorityOpt = "normal",
    timeout_s: TimeoutOpt = None,
    tenant: TenantOpt = None,
    wait_s: WaitOpt = 30.0,
    queue_anyway: QueueAnywayOpt = False,
    model: ModelOpt = None,
    model_version: VersionOpt = None,
) -> None:
    """Submit any modality with inputs given as JSON (checked by the worker only)."""
    try:
        parsed = json.loads(inputs)
    except json.JSONDecodeError as exc:
        fail(InvalidInput(f"--inputs is not JSON: {exc}"))
        return
    run_submit(
        modality,
        lambda _c: parsed,
        priority=priority,
        timeout_s=timeout_s,
        tenant=tenant,
        wait_s=wait_s,
        queue_anyway=queue_anyway,
        model=model,
        version=model_version,
    )


__all__ = ["check_file", "check_text", "one_text", "read_text_file", "run_submit"]
