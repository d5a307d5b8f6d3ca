"""Pure parts of ``fleet bench submit-rate`` (``producer/tools/bench/submitrate.py``): fresh copies
of a captured message, per-path summaries, ratios, the table. No I/O but the console.

Rates are requests per second; CPU and wall times per request in microseconds.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from producer.tools.bench.accounting import counter_delta as counter_delta  # re-exported
from producer.tools.bench.stats import spread

PATHS = ("raw", "submit_many", "submit", "submit_many+wait")
SEND_PATHS = PATHS[:3]  # the paths measured without workers, in rotating order per round
TARGET_RATIO = 0.5  # the goal: submit_many at least half the raw pipeline limit
METHOD = {
    "raw": "LPUSH of the exact bytes submit_many sent in the capture pass (fresh task ids and "
    "delivery tags, copies built before the clock starts) to the same priority list keys, "
    "pipelines of `chunk` on one connection of the producer's ACL user",
    "submit_many": "FleetClient.submit_many in chunks of `chunk` from one thread, no waiting "
    "(validation, queue-length check per chunk, message and task-sent event from templates, "
    "one MULTI/EXEC per chunk: an LPUSH per list and one PUBLISH of the chunk's events)",
    "submit": "FleetClient.submit, one request at a time (each its own queue-length check)",
    "submit_many+wait": "one text worker (batch mode) running: submit_many in chunks, then "
    "wait_all (MGET polls) until every result is stored; rps = requests / (last result's "
    "date_done - first send), wall clock",
    "rps": "median over rounds of requests / elapsed time of the path (perf_counter)",
    "cpu_us_per_request": "the producer process's CPU time (user + system) over the path / N",
    "commands_per_request": "Redis INFO commandstats delta over the path's rounds / requests, "
    "every client (for submit_many+wait the worker's too); the harness's INFO excluded",
}


def fresh_copy(message: bytes) -> bytes:
    """``message`` (a kombu JSON envelope as Redis holds it) with a new task id and delivery
    tag: every occurrence replaced by a fresh uuid4 of the same length, nothing else changed.

    Raises:
        ValueError: not a JSON kombu message with ``headers.id`` and a delivery tag.
    """
    try:
        doc = json.loads(message)
        task_id = doc["headers"]["id"]
        tag = doc["properties"]["delivery_tag"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not a kombu task message: {exc}") from None
    out = message.replace(task_id.encode(), str(uuid.uuid4()).encode())
    return out.replace(tag.encode(), str(uuid.uuid4()).encode())


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` rounded to 4 places, or ``None`` when either is missing or ``b`` is 0."""
    return None if a is None or not b else round(a / b, 4)


def rate(requests: int, seconds: float) -> float:
    """Requests per second; raises ``ValueError`` for a non-positive duration."""
    if seconds <= 0:
        raise ValueError(f"a duration must be positive, not {seconds}")
    return requests / seconds


def summarize_path(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One path's figures over its rounds (each ``{"rps", "cpu_us_per_request", ...}``):
    ``rps`` (median), ``rps_spread`` {min, median, max}, ``cpu_us_per_request`` (median),
    and the rounds themselves. ``rps`` is ``None`` when no round produced a rate."""
    rates = spread(r.get("rps") for r in rounds)
    cpu = spread(r.get("cpu_us_per_request") for r in rounds)
    return {
        "rps": None if rates is None else round(rates["median"], 1),
        "rps_spread": None if rates is None else {k: round(v, 1) for k, v in rates.items()},
        "cpu_us_per_request": None if cpu is None else round(cpu["median"], 1),
        "rounds": list(rounds),
    }


def ratios(paths: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """Each producer path's median rate over the raw limit's."""
    raw = paths.get("raw", {}).get("rps")
    return {
        f"{name}_over_raw": ratio(paths.get(name, {}).get("rps"), raw)
        for name in ("submit_many", "submit", "submit_many+wait")
    }


def per_request(delta: Mapping[str, int], requests: int, ignore: Sequence[str] = ()) -> dict:
    """Commands per request by name, largest first (``delta``: calls over ``requests``)."""
    if requests <= 0:
        return {}
    kept = {k: v for k, v in delta.items() if k not in ignore and v > 0}
    return {k: round(v / requests, 3) for k, v in sorted(kept.items(), key=lambda kv: -kv[1])}


def verdict(ratio_many: float | None) -> dict[str, Any]:
    """The issue's target on submit_many's ratio: ``met`` is ``None`` without a ratio."""
    met = None if ratio_many is None else ratio_many >= TARGET_RATIO
    return {"target_submit_many_over_raw": TARGET_RATIO, "met": met}


def _f(x: float | None, fmt: str = ",.1f") -> str:
    return "-" if x is None else format(x, fmt)


def _table(report: Mapping[str, Any]) -> Table:
    sr = report["submit_rate"]
    t = Table(
        title=f"Producer submit rate: {sr['requests']} text requests per path and round, "
        f"{report['repetitions']} round(s), chunk {sr['chunk']} (requests/s)"
    )
    for col in ("path", "median", "min", "max", "x raw", "CPU us/req", "Redis cmds/req"):
        t.add_column(col, justify="left" if col == "path" else "right")
    raw = sr["paths"].get("raw", {}).get("rps")
    for name in PATHS:
        p = sr["paths"].get(name)
        if p is None:
            continue
        sp = p.get("rps_spread") or {}
        cmds = sr.get("commands_per_request", {}).get(name) or {}
        t.add_row(
            name,
            _f(p.get("rps")),
            _f(sp.get("min")),
            _f(sp.get("max")),
            _f(ratio(p.get("rps"), raw), ".3f"),
            _f(p.get("cpu_us_per_request")),
            ", ".join(f"{k} {v:g}" for k, v in list(cmds.items())[:4]) or "-",
        )
    return t


def print_submit_rate_report(report: Mapping[str, Any], console: Console | None = None) -> None:
    """The table, the ratios against the target and the warnings."""
    console = console or Console()
    console.print(_table(report))
    sr = report["submit_rate"]
    v = sr["verdict"]
    met = {True: "met", False: "not met", None: "undecided"}[v["met"]]
    console.print(
        f"submit_many / raw = {_f(sr['ratios']['submit_many_over_raw'], '.3f')} "
        f"(target >= {v['target_submit_many_over_raw']}: {met}); submit / raw = "
        f"{_f(sr['ratios']['submit_over_raw'], '.3f')}; message {sr['message_bytes']} B"
    )
    for w in report.get("warnings", []):
        console.print(f"[yellow]warning:[/yellow] {w}")
