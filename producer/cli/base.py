"""What every ``fleet`` command shares: the Typer apps, exit codes, JSON output, settings
(with the running stack's recorded addresses) and the diagnosis of an unusable stack.

Exit codes (documented in the README, *Exit codes*):

- 0: success.
- 1: the request failed (a fleet error of the request, e.g. ``DEADLINE_EXCEEDED``,
  ``MODEL_ERROR``, ``QUEUE_FULL``) or waiting for it timed out (``WAIT_TIMEOUT``).
- 2: refused input: a bad option, a missing or empty file, a coded input error
  (``INVALID_INPUT`` and its family: ``PAYLOAD_TOO_LARGE``, ``IMAGE_DECODE``, ...), or a
  configuration error.
- 3: the stack or the broker is not usable: not started, Redis unreachable or refusing the
  credentials, a port taken, a process down, no live worker for the modality
  (``NO_READY_WORKER``).
- 4: ``fleet result`` / ``fleet watch`` of an id the fleet does not know: not queued, not
  held by a worker, no result (mistyped, or its result expired after
  ``[redis] result_expires_s``).

Expected conditions print one or two lines on stderr (cause and fix), never a traceback.
Request outcomes (``submit``, ``result``, ``watch``) are JSON on stdout.
"""

from __future__ import annotations

import json
import os
from enum import IntEnum
from typing import Any

import click
import typer
from typer.core import TyperGroup

from shared.errors import ERROR_CLASSES, FleetError, InvalidInput
from shared.settings import REDIS_URL_VARIABLE, Settings, load_settings


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # the request failed or timed out
    REFUSED = 2  # refused input (or configuration)
    STACK = 3  # the stack or broker is not usable
    UNKNOWN_ID = 4  # `fleet result` / `fleet watch` of an id the fleet does not know


STACK_CODES = frozenset({"NO_READY_WORKER", "BROKER_UNAVAILABLE"})
"""Error codes that mean the stack, not the request, is the problem (exit 3)."""

# What a process that loads models runs with unless told otherwise (`fleet worker`, `fleet
# prepare`): no hub (nothing is downloaded), no progress bars, no tokenizer thread pool.
MODEL_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


def exit_code_for(code: str) -> ExitCode:
    """The exit status for a request's error ``code`` (see the module docstring)."""
    if code in STACK_CODES:
        return ExitCode.STACK
    cls = ERROR_CLASSES.get(code)
    if cls is not None and issubclass(cls, InvalidInput):
        return ExitCode.REFUSED
    return ExitCode.FAILED


class WaitTimeout(Exception):
    """The CLI stopped waiting before the request's final result; the request may still be
    queued or running (``fleet result ID`` reads it later). Code ``WAIT_TIMEOUT``, exit 1.
    Not a ``FleetError``: the request itself did not fail, and no worker or the gateway
    ever stores it."""

    code = "WAIT_TIMEOUT"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "type": type(self).__name__}


class CliProblem(Exception):
    """An expected condition a command cannot get past: ``message`` (one or two lines: the
    cause and the fix) goes to stderr and the process exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = ExitCode.STACK) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = int(exit_code)


class FleetGroup(TyperGroup):
    """The top-level command group: turns expected conditions into their message and exit
    code (no traceback); anything else is a bug and keeps its traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        from pydantic import ValidationError

        try:
            return super().invoke(ctx)
        except CliProblem as p:
            typer.echo(p.message, err=True)
            raise typer.Exit(p.exit_code) from None
        except ValidationError as exc:
            typer.echo(config_message(exc), err=True)
            raise typer.Exit(ExitCode.REFUSED) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None


def config_message(exc: Any) -> str:
    """One line per configuration error: which key, what is wrong, where to fix it."""
    from shared.model_kinds import config_key_path
    from shared.settings import config_paths

    errs = exc.errors()[:3]
    parts = [f"{config_key_path(e['loc'])}: {e['msg']}" for e in errs]
    try:
        files = ":".join(str(p) for p in config_paths())
    except FileNotFoundError as fnf:
        files = str(fnf)
    return (
        f"invalid configuration: {'; '.join(parts)}\n"
        f"  fix it in {files} or in the FLEET_* variable of that key"
    )


app = typer.Typer(
    cls=FleetGroup,
    help="Multimodal inference worker fleet on Celery + Redis. Exit codes: 0 ok, 1 the "
    "request failed or timed out, 2 refused input, 3 the stack or broker is not usable, 4 an "
    "unknown request id (fleet result/watch).",
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)
submit_app = typer.Typer(help="Submit one request and print its result as JSON.")
app.add_typer(submit_app, name="submit")
shm_app = typer.Typer(help="Inspect and clean the /dev/shm tensor segments of this host.")
app.add_typer(shm_app, name="shm")


def check_seconds(option: str, value: float, *, positive: bool = False) -> None:
    """A duration option: at least 0 (``positive``: above 0), and finite.

    Raises:
        CliProblem: one line naming the option and its value (exit 2).
    """
    import math

    bad = not math.isfinite(value) or value < 0 or (positive and value == 0)
    if bad:
        need = "above 0" if positive else "0 or more"
        raise CliProblem(f"{option} must be {need} seconds, not {value:g}", ExitCode.REFUSED)


# -- output ---------------------------------------------------------------------------------
def emit(obj: Any) -> None:
    """One compact JSON object on stdout."""
    typer.echo(json.dumps(obj, indent=None, separators=(",", ":")))


def fail(exc: FleetError | WaitTimeout, task_id: str | None = None, hint: str = "") -> None:
    """Print a request's coded error as JSON (and ``hint`` on stderr); exit by its code.

    Raises:
        typer.Exit: always.
    """
    emit({**({"id": task_id} if task_id else {}), "error": exc.to_dict()})
    if hint:
        typer.echo(hint, err=True)
    raise typer.Exit(exit_code_for(exc.code))


# -- settings -------------------------------------------------------------------------------
def cli_settings() -> Settings:
    """Settings for a command: config + ``FLEET_*``, plus the addresses the running stack of
    the run dir recorded at ``fleet up`` (``stack.json``) for keys the environment leaves
    unset, so ``FLEET_FLOWER__PORT=5556 fleet up`` then ``fleet flower`` prints 5556.

    Raises:
        CliProblem: ``FLEET_CONFIG`` names a missing file (exit 2).
        pydantic.ValidationError: a bad value (the group reports it, exit 2).
    """
    try:
        settings = load_settings()
    except FileNotFoundError as exc:
        raise CliProblem(f"{exc}; fix or unset FLEET_CONFIG", ExitCode.REFUSED) from None
    from producer.stack.local import Stack

    state = Stack(settings).read_state()
    overrides = recorded_overrides(state or {}, os.environ)
    return load_settings(**overrides) if overrides else settings


def recorded_overrides(state: dict[str, Any], env: Any) -> dict[str, dict[str, Any]]:
    """The recorded values of ``state`` (``{section: {key: value}}``) that no
    ``FLEET_<SECTION>__<KEY>`` variable in ``env`` sets (those win), nor, for the Redis
    address, ``FLEET_REDIS_URL``."""
    names = {k.upper() for k in env}
    out: dict[str, dict[str, Any]] = {}
    for section, values in state.items():
        if not isinstance(values, dict) or (section == "redis" and REDIS_URL_VARIABLE in names):
            continue
        kept = {k: v for k, v in values.items() if f"FLEET_{section}__{k}".upper() not in names}
        if kept:
            out[section] = kept
    return out
