"""``fleet result ID`` and ``fleet watch ID``: read a request's outcome later.

A result document (``celery-task-meta-<id>``) is kept ``[redis] result_expires_s`` (a day
by default). No document reads as ``PENDING``: queued and not taken yet, or an unknown or
expired id (Redis cannot tell them apart without scanning the queues).
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from producer.cli.base import ExitCode, WaitTimeout, app, cli_settings, emit, exit_code_for
from producer.cli.output import jsonable

FINAL = frozenset({"SUCCESS", "FAILURE", "REVOKED"})
STATE_WORDS = {
    "PENDING": "queued, not taken by a worker yet (or an unknown or expired id)",
    "PROGRESS": "running",
    "STARTED": "running",
    "RETRY": "being retried",
}


def read_meta(client: Any, task_id: str) -> dict[str, Any]:
    """The task's result document as stored now (one GET); ``{"status": "PENDING"}`` if none."""
    backend = client.app.backend
    raw = backend.client.get(backend.get_key_for_task(task_id))
    return {"status": "PENDING"} if raw is None else backend.decode_result(raw)


def report(task_id: str, meta: dict[str, Any], full: bool) -> tuple[dict[str, Any], int]:
    """The JSON line of a result document and its exit code (0 success, 1/2 by error code;
    1 while not final)."""
    from producer.client import outcome_from_meta

    state = str(meta.get("status", "PENDING"))
    out: dict[str, Any] = {"id": task_id, "state": state}
    if state not in FINAL:
        progress = meta.get("result")
        if state == "PROGRESS" and isinstance(progress, dict):
            out["progress"] = progress
        return out, ExitCode.FAILED
    outcome = outcome_from_meta(meta)
    if "result" in outcome:
        out["result"] = jsonable(outcome["result"], full)
        return out, ExitCode.OK
    out["error"] = outcome["error"]
    return out, exit_code_for(outcome["error"]["code"])


def _client() -> tuple[Any, Any]:
    from producer.cli.diagnose import require_broker
    from producer.client import FleetClient

    settings = cli_settings()
    require_broker(settings)
    return settings, FleetClient(settings)


@app.command()
def result(
    task_id: Annotated[str, typer.Argument(metavar="ID", help="the id `fleet submit` printed")],
    wait_s: Annotated[float, typer.Option(help="wait this long for a final result")] = 0.0,
    full: Annotated[bool, typer.Option("--full", help="print tensor outputs in full")] = False,
) -> None:
    """Print a request's outcome as JSON: {"id", "state", "result"} or {..., "error"}.
    Exit 0 on success, 1 (2 for refused input) on a coded failure, 1 while not final.

    Tensor outputs (a video's frame_embeddings) print as shapes; --full reads them from
    /dev/shm on this host while their segments live (the first reader that resolves them,
    such as a waiting `fleet submit`, releases them)."""
    from producer.cli.diagnose import broker_errors, broker_lost

    settings, client = _client()
    try:
        deadline = time.monotonic() + wait_s
        meta = read_meta(client, task_id)
        while meta.get("status") not in FINAL and time.monotonic() < deadline:
            time.sleep(0.1)
            meta = read_meta(client, task_id)
        if full and meta.get("status") == "SUCCESS":
            meta = {**meta, "result": client.resolve(meta["result"], release=False)}
        out, code = report(task_id, meta, full)
    except broker_errors() as exc:
        raise broker_lost(settings, exc) from None
    finally:
        client.close()
    emit(out)
    if out["state"] not in FINAL:
        words = STATE_WORDS.get(out["state"], out["state"])
        typer.echo(f"no final result yet: {out['state']} ({words}); wait with --wait-s", err=True)
    raise typer.Exit(code)


@app.command()
def watch(
    task_id: Annotated[str, typer.Argument(metavar="ID", help="the id `fleet submit` printed")],
    timeout_s: Annotated[float, typer.Option(help="give up after this many seconds")] = 600.0,
    interval_s: Annotated[float, typer.Option(help="polling interval")] = 0.25,
) -> None:
    """Follow a request: one JSON line per change of state or progress (a video's done/total
    frames) until its final result, printed as `fleet result` does; same exit codes, and
    1 with WAIT_TIMEOUT when it is not final within --timeout-s."""
    from producer.cli.diagnose import broker_errors, broker_lost

    settings, client = _client()
    last: dict[str, Any] | None = None
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            out, code = report(task_id, read_meta(client, task_id), full=False)
            if out["state"] in FINAL:
                emit(out)
                raise typer.Exit(code)
            if out != last:
                emit(out)
                last = out
            if time.monotonic() >= deadline:
                err = WaitTimeout(f"not final within {timeout_s:g} s; its state is {out['state']}")
                emit({"id": task_id, "state": out["state"], "error": err.to_dict()})
                raise typer.Exit(ExitCode.FAILED)
            time.sleep(interval_s)
    except broker_errors() as exc:
        raise broker_lost(settings, exc) from None
    finally:
        client.close()
