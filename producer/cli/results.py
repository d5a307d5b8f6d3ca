"""``fleet result ID`` and ``fleet watch ID``: read a request's outcome later.

A result document (``celery-task-meta-<id>``) is kept ``[redis] result_expires_s`` (a day
by default). A request without one is looked for where the fleet keeps it
(:mod:`producer.cli.locate`): queued (its position), held by a worker, or unknown: an id
the fleet does not know (mistyped, or its result expired) exits 4 with ``UNKNOWN_REQUEST``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from producer.cli import locate as loc
from producer.cli.base import (
    ExitCode,
    WaitTimeout,
    app,
    check_seconds,
    cli_settings,
    emit,
    exit_code_for,
    fail,
)
from producer.cli.output import jsonable
from shared.errors import InvalidInput
from shared.settings import Settings

FINAL = frozenset({"SUCCESS", "FAILURE", "REVOKED"})
STATE_WORDS = {
    "PENDING": "not taken by a worker yet",
    "PROGRESS": "running",
    "STARTED": "running",
    "RETRY": "being retried",
}


PROBE_EVERY_S = 2.0  # how often `fleet result --wait-s` looks for a request without a result


def request_id(given: str) -> str:
    """The id as given, without the blanks a pasted id often brings; an empty one (a shell
    variable the failed line before left empty) is refused as input, exit 2, before any
    connection is made."""
    task_id = given.strip()
    if not task_id:
        fail(InvalidInput("the request id is empty: give the id `fleet submit` printed"))
    return task_id


def read_meta(client: Any, task_id: str) -> dict[str, Any] | None:
    """The task's result document as stored now (one GET); ``None`` if there is none."""
    backend = client.app.backend
    raw = backend.client.get(backend.get_key_for_task(task_id))
    return None if raw is None else backend.decode_result(raw)


def unknown_message(task_id: str, settings: Settings) -> str:
    """One line: the fleet does not know ``task_id``."""
    return (
        f"unknown request id {task_id!r}: not queued, not held by a worker, no result "
        "(mistyped, or its result expired: results are kept [redis] result_expires_s = "
        f"{settings.redis.result_expires_s:g} s)"
    )


def unknown_exit(task_id: str, settings: Settings) -> None:
    """Print the ``UNKNOWN_REQUEST`` outcome (JSON on stdout, one line on stderr); exit 4.

    Raises:
        typer.Exit: always.
    """
    message = unknown_message(task_id, settings)
    error = {"code": "UNKNOWN_REQUEST", "message": message, "type": "UnknownRequest"}
    emit({"id": task_id, "state": "UNKNOWN", "error": error})
    typer.echo(message, err=True)
    raise typer.Exit(ExitCode.UNKNOWN_ID)


def no_worker_hint(settings: Settings, client: Any, where: loc.Location | None) -> str:
    """``"; no live worker consumes queue 'video' (...)"`` for a queued request whose queue
    nobody reads (one round trip), else ``""``."""
    from producer.cli.diagnose import live_nodes

    if where is None or where.where != loc.QUEUED:
        return ""
    modality = where.queue.split(".", 1)[0]
    if live_nodes(settings, client, modality):
        return ""
    return (
        f"; no live worker consumes queue {where.queue!r}: start one with "
        f"`fleet up --modalities {modality}`"
    )


class Prober:
    """Looks for requests without a result document (:mod:`producer.cli.locate`) over one
    connection of its own: the operator role's when this run dir has its password (it may
    read the queues), else the producer's (final traces only)."""

    def __init__(self, settings: Settings) -> None:
        from producer.cli.diagnose import probe_client

        self.can_read_queues = True
        try:
            user, password = settings.redis_credentials("operator")
        except FileNotFoundError:
            user, password = settings.redis_credentials("producer")
            self.can_read_queues = False
        self.client = probe_client(settings, user, password)
        from shared.model_routes import catalog

        self.queues = [  # the queues of the models that are not a modality's default
            q
            for m in settings.modalities
            for s in catalog(settings, m)
            if not s.default
            for q in (s.queue, s.realtime_queue)
        ]
        default = settings.tenancy.default_tenant
        self.tenants = sorted(t for t in settings.tenants if t != default)  # own lists

    def locate(self, task_id: str) -> loc.Location:
        """Raises: redis connection errors."""
        from redis.exceptions import NoPermissionError

        if self.can_read_queues:
            try:
                return loc.locate(self.client, task_id, models=self.queues, tenants=self.tenants)
            except NoPermissionError:  # a producer user's FLEET_REDIS__PASSWORD
                self.can_read_queues = False
        return loc.locate(self.client, task_id, can_read_queues=False)

    def close(self) -> None:
        self.client.close()


def report(
    task_id: str, meta: dict[str, Any] | None, full: bool, where: loc.Location | None = None
) -> tuple[dict[str, Any], int]:
    """The JSON line of a result document (``None``: none yet, ``where`` says where the
    request is) and its exit code (0 success, 1/2 by error code; 1 while not final)."""
    from producer.client import outcome_from_meta

    if meta is None:
        out = {"id": task_id, "state": "PENDING", **(where.to_dict() if where else {})}
        return out, ExitCode.FAILED
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


def _client() -> tuple[Any, Any, Prober]:
    from producer.cli.diagnose import require_broker
    from producer.client import FleetClient

    settings = cli_settings()
    require_broker(settings)
    return settings, FleetClient(settings), Prober(settings)


@app.command()
def result(
    task_id: Annotated[str, typer.Argument(metavar="ID", help="the id `fleet submit` printed")],
    wait_s: Annotated[float, typer.Option(help="wait this long for a final result")] = 0.0,
    full: Annotated[bool, typer.Option("--full", help="print tensor outputs in full")] = False,
) -> None:
    """Print a request's outcome as JSON: {"id", "state", "result"} or {..., "error"}.
    Exit 0 on success, 1 (2 for refused input) on a coded failure, 1 while not final
    (with where it is: "queued" with its position, or "held" by a worker), 4 for an id the
    fleet does not know (UNKNOWN_REQUEST: mistyped, or its result expired).

    Tensor outputs (a video's frame_embeddings) print as shapes; --full reads them from
    /dev/shm on this host while their segments live (the first reader that resolves them,
    such as a waiting `fleet submit`, releases them)."""
    from producer.cli.diagnose import broker_errors, broker_lost

    check_seconds("--wait-s", wait_s)
    task_id = request_id(task_id)
    settings, client, prober = _client()
    try:
        deadline = time.monotonic() + wait_s
        meta = read_meta(client, task_id)
        where: loc.Location | None = None
        next_probe = 0.0
        while meta is None or meta.get("status") not in FINAL:
            now = time.monotonic()
            if meta is None and now >= next_probe:
                where = prober.locate(task_id)
                next_probe = now + PROBE_EVERY_S
                if where.where == loc.UNKNOWN:
                    break
            if now >= deadline:
                break
            time.sleep(0.1)
            meta = read_meta(client, task_id)
        if meta is None and where is not None and where.where == loc.UNKNOWN:
            unknown_exit(task_id, settings)
        if meta is None and where is not None and where.where == loc.FINAL:
            meta = read_meta(client, task_id)  # stored while it was looked for
        if full and meta is not None and meta.get("status") == "SUCCESS":
            meta = {**meta, "result": client.resolve(meta["result"], release=False)}
        out, code = report(task_id, meta, full, where)
        hint = no_worker_hint(settings, client, where) if meta is None else ""
    except broker_errors() as exc:
        raise broker_lost(settings, exc) from None
    finally:
        client.close()
        prober.close()
    emit(out)
    if out["state"] not in FINAL:
        words = where.words() if meta is None and where else STATE_WORDS.get(out["state"], "")
        typer.echo(
            f"no final result yet: {out['state']} ({words}); wait with --wait-s, or follow it "
            f"with `fleet watch {task_id}`{hint}",
            err=True,
        )
    raise typer.Exit(code)


@app.command()
def watch(
    task_id: Annotated[str, typer.Argument(metavar="ID", help="the id `fleet submit` printed")],
    timeout_s: Annotated[float, typer.Option(help="give up after this many seconds")] = 600.0,
    interval_s: Annotated[float, typer.Option(help="polling interval")] = 0.25,
    report_s: Annotated[
        float, typer.Option(help="how often to say where a request not yet taken is")
    ] = 10.0,
) -> None:
    """Follow a request: one JSON line per change of state, of where it is (queued, held by
    a worker) or of progress (a video's done/total frames) until its final result, printed
    as `fleet result` does, with the same exit codes; every --report-s a `still queued,
    position N of M` line on stderr; 4 at once for an id the fleet does not know; 1 with
    WAIT_TIMEOUT when it is not final within --timeout-s."""
    from producer.cli.diagnose import broker_errors, broker_lost

    check_seconds("--timeout-s", timeout_s)
    check_seconds("--interval-s", interval_s, positive=True)
    check_seconds("--report-s", report_s, positive=True)
    task_id = request_id(task_id)
    settings, client, prober = _client()
    last: dict[str, Any] | None = None
    where: loc.Location | None = None
    try:
        start = time.monotonic()
        deadline = start + timeout_s
        next_probe = start
        while True:
            now = time.monotonic()
            meta = read_meta(client, task_id)
            if meta is None and now >= next_probe:
                where = prober.locate(task_id)
                next_probe = now + report_s
                if where.where == loc.UNKNOWN:
                    unknown_exit(task_id, settings)
                if where.where != loc.FINAL and last is not None:
                    hint = no_worker_hint(settings, client, where)
                    typer.echo(f"still {where.words()} (after {now - start:.0f} s){hint}", err=True)
            out, code = report(task_id, meta, full=False, where=where if meta is None else None)
            if out["state"] in FINAL:
                emit(out)
                raise typer.Exit(code)
            changed = {k: v for k, v in out.items() if k not in ("position", "queued")}
            if last is None or changed != last:
                emit(out)
                last = changed
            if now >= deadline:
                err = WaitTimeout(f"not final within {timeout_s:g} s; its state is {out['state']}")
                emit({"id": task_id, "state": out["state"], "error": err.to_dict()})
                raise typer.Exit(ExitCode.FAILED)
            time.sleep(interval_s)
    except broker_errors() as exc:
        raise broker_lost(settings, exc) from None
    finally:
        client.close()
        prober.close()
