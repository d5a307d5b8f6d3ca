"""The benches ``make gpu-check`` runs after the device checks, short, under one time budget.

Three parts, each a shipped workload cut down to one repetition and a short phase, run as
``fleet bench`` in a subprocess (its report under ``reports/gpucheck/<part>/``):

- ``overhead``: ``overhead-saturate`` (text on the ``identity`` model: no weights, no
  compute), modes ``fleet`` and ``redis-limit``: what the fleet itself costs per request on
  this machine's CPUs (CPU by process, Redis CPU and commands per request), the figure to set
  beside the CUDA rates. The identity model does no device work, so it runs on the shipped
  configuration and also on a machine without CUDA;
- ``text``: ``text-saturate`` on CUDA (``configs/overlays/gpu.toml`` added to
  ``FLEET_CONFIG``), mode ``fleet``: one text worker's capacity on the GPU;
- ``image``: ``image-saturate`` on CUDA, mode ``fleet``: one image worker's capacity.

The budget: the whole of ``make gpu-check`` must end within 10 minutes. :func:`plan` gives
each part an estimate (per mode: the stack's start with its model loaded and warmed, the
warmup, the phase, the accounting's idle window, the drain; plus the bench process's own
start) and refuses a plan whose estimates, with the device checks', pass the budget.
At run time :func:`run_parts` skips a part when less than its estimate is left before the
deadline, and kills one that runs past its allotment (its estimate x :data:`SLACK`, never past
the deadline), so a slow machine loses a part, not the 10 minutes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
GPU_OVERLAY = "configs/overlays/gpu.toml"
BUDGET_S = 540.0  # 10 minutes less a minute for the interpreter, torch's import, the report
DEVICE_CHECKS_S = 150.0  # the five device checks (mostly starting their child processes)
BENCH_PROCESS_S = 10.0  # one `fleet bench` process: imports, Redis, the report
SLACK = 1.5  # a part may run this many times its estimate (within the deadline)

__all__ = [
    "BUDGET_S",
    "DEVICE_CHECKS_S",
    "PARTS",
    "BenchPart",
    "PlanError",
    "bench_env",
    "plan",
    "run_parts",
    "summarise",
    "workload_text",
]


class PlanError(ValueError):
    """The parts asked for cannot fit the budget, or a part is unknown."""


@dataclass(frozen=True)
class BenchPart:
    """One bench of the check: the shipped workload it is cut from and how short."""

    name: str
    workload: str  # a name in configs/workloads
    modes: tuple[str, ...]
    cuda: bool  # runs on CUDA (the GPU overlay); skipped without a CUDA device
    modality: str
    start_s: float  # estimated start of one mode's stack: workers up, model loaded and warmed
    warmup_s: float
    duration_s: float
    idle_s: float = 0.0  # the accounting's idle window (overhead-saturate only)
    drain_s: float = 10.0  # what is in flight at the phase's end, collected

    def estimate_s(self) -> float:
        """Seconds the part should take, its bench process's own start included."""
        per_mode = self.start_s + self.warmup_s + self.duration_s + self.idle_s + self.drain_s
        return BENCH_PROCESS_S + len(self.modes) * per_mode

    @property
    def title(self) -> str:
        where = "CUDA" if self.cuda else "this machine's CPUs"
        return f"bench {self.name} ({self.workload}, {'+'.join(self.modes)}, {where})"


PARTS: dict[str, BenchPart] = {
    p.name: p
    for p in (
        BenchPart(
            "overhead",
            "overhead-saturate",
            ("fleet", "redis-limit"),
            cuda=False,
            modality="text",
            start_s=15.0,
            warmup_s=2.0,
            duration_s=10.0,
            idle_s=1.0,
        ),
        BenchPart(
            "text",
            "text-saturate",
            ("fleet",),
            cuda=True,
            modality="text",
            start_s=45.0,
            warmup_s=3.0,
            duration_s=15.0,
        ),
        BenchPart(
            "image",
            "image-saturate",
            ("fleet",),
            cuda=True,
            modality="image",
            start_s=60.0,
            warmup_s=3.0,
            duration_s=15.0,
        ),
    )
}


def plan(
    names: Sequence[str],
    budget_s: float = BUDGET_S,
    device_checks: bool = True,
    cuda: bool = True,
) -> list[tuple[BenchPart, str | None]]:
    """The parts ``names`` in order, each with ``None`` (it runs) or why it is skipped (a CUDA
    part without a CUDA device).

    Raises:
        PlanError: an unknown part, or the estimates of what runs (the device checks'
            :data:`DEVICE_CHECKS_S` included when ``device_checks``) pass ``budget_s``.
    """
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        raise PlanError(f"unknown bench part(s) {', '.join(unknown)}; known: {', '.join(PARTS)}")
    out = [(PARTS[n], None if cuda or not PARTS[n].cuda else "no CUDA device") for n in names]
    total = (DEVICE_CHECKS_S if device_checks else 0.0) + sum(
        p.estimate_s() for p, skip in out if skip is None
    )
    if total > budget_s:
        raise PlanError(f"the plan needs about {total:.0f} s, over the {budget_s:.0f} s budget")
    return out


def _set(text: str, key: str, value: str) -> str:
    """Every ``key = ...`` line of a TOML text set to ``value``.

    Raises:
        PlanError: the text has no such line (the shipped workload changed shape).
    """
    new, n = re.subn(rf"(?m)^{re.escape(key)} = .*$", f"{key} = {value}", text)
    if not n:
        raise PlanError(f"the workload has no `{key} = ...` line to shorten")
    return new


def workload_text(part: BenchPart) -> str:
    """The shipped workload's TOML, cut down: its own name, one repetition, the part's warmup,
    phase length and (when it has one) accounting idle window."""
    text = (REPO / "configs/workloads" / f"{part.workload}.toml").read_text()
    text = _set(text, "name", json.dumps(f"gpucheck-{part.name}"))
    text = _set(text, "repetitions", "1")
    text = _set(text, "warmup_s", repr(part.warmup_s))
    text = _set(text, "duration_s", repr(part.duration_s))
    if part.idle_s:
        text = _set(text, "accounting_idle_s", repr(part.idle_s))
    return text


def bench_env(part: BenchPart, environ: dict[str, str]) -> dict[str, str]:
    """The bench's environment: ``environ``, plus the GPU overlay in ``FLEET_CONFIG`` for a
    CUDA part (unless it is there already)."""
    env = dict(environ)
    if part.cuda:
        config = env.get("FLEET_CONFIG") or "configs/fleet.toml"
        if GPU_OVERLAY not in config.split(":"):
            config = f"{config}:{GPU_OVERLAY}"
        env["FLEET_CONFIG"] = config
    return env


def summarise(part: BenchPart, report: dict[str, Any]) -> tuple[bool, dict[str, Any], str]:
    """A bench report's verdict (every mode served requests), its key figures, one line."""
    modes = report.get("modes") or {}
    figs: dict[str, Any] = {}
    problems = []
    for mode in part.modes:
        rps = ((modes.get(mode) or {}).get(part.modality) or {}).get("throughput_rps")
        figs[f"{mode}_rps"] = rps
        if not rps:
            problems.append(f"{mode} served no {part.modality} request")
    for key in ("cpu_us_per_request", "redis_cpu_us_per_request"):
        value = (report.get(key) or {}).get("fleet")
        if value is not None:
            figs[f"fleet_{key}"] = value
    commands = ((report.get("accounting") or {}).get("fleet") or {}).get(
        "redis_commands_per_request"
    )
    if commands is not None:
        figs["fleet_redis_commands_per_request"] = commands
    line = ", ".join(f"{m} {figs[f'{m}_rps'] or 0:,.1f} req/s" for m in part.modes)
    cpu = figs.get("fleet_cpu_us_per_request")
    if isinstance(cpu, dict) and cpu.get("total") is not None:
        line += f"; fleet CPU {cpu['total']:,.0f} us/request"
    redis_cpu = figs.get("fleet_redis_cpu_us_per_request")
    if isinstance(redis_cpu, int | float):
        line += f", Redis CPU {redis_cpu:,.1f} us/request"
    if commands is not None:
        line += f", {commands:.2f} Redis commands/request"
    return not problems, figs, "; ".join(problems) or line


@dataclass
class PartResult:
    name: str
    ok: bool
    figures: dict[str, Any]
    detail: str
    seconds: float = 0.0
    skipped: bool = False


def run_part(part: BenchPart, out_dir: Path, timeout_s: float) -> PartResult:
    """One part: its workload written, ``fleet bench`` run with ``timeout_s``, its report
    read. The bench's output goes to ``out_dir/bench.log``."""
    out_dir = out_dir.resolve()  # the bench runs in the repository's root
    out_dir.mkdir(parents=True, exist_ok=True)
    workload = out_dir / f"gpucheck-{part.name}.toml"
    workload.write_text(workload_text(part))
    cmd = [
        sys.executable, "-m", "producer.cli", "bench", str(workload),
        "--repetitions", "1", "--modes", ",".join(part.modes), "--no-plot",
        "--out-dir", str(out_dir), "--run-dir", str(out_dir / "run"),
    ]  # fmt: skip
    log = out_dir / "bench.log"
    (out_dir / "latest.json").unlink(missing_ok=True)
    with log.open("w") as f:
        try:
            proc = subprocess.run(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                cwd=REPO,
                env=bench_env(part, dict(os.environ)),
            )
        except subprocess.TimeoutExpired:
            return PartResult(part.title, False, {}, f"ran past {timeout_s:.0f} s (log: {log})")
    latest = out_dir / "latest.json"
    if proc.returncode != 0 or not latest.is_file():
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
        return PartResult(part.title, False, {}, f"exit {proc.returncode}: {tail} (log: {log})")
    ok, figs, detail = summarise(part, json.loads(latest.read_text()))
    figs["report"] = str(latest)
    return PartResult(part.title, ok, figs, detail)


def run_parts(
    planned: Sequence[tuple[BenchPart, str | None]],
    deadline: float,
    out_root: Path,
    out: Callable[[str], None] = print,
    runner: Callable[[BenchPart, Path, float], PartResult] = run_part,
    clock: Callable[[], float] = time.monotonic,
) -> list[PartResult]:
    """Run the planned parts in order before ``deadline`` (a ``clock`` time); print a line
    each (PASS, FAIL or SKIP)."""
    results = []
    for part, skip in planned:
        left = deadline - clock()
        if skip is None and left < part.estimate_s():
            skip = f"{left:.0f} s of the budget left, the part needs about {part.estimate_s():.0f}"
        if skip is not None:
            res = PartResult(part.title, True, {}, skip, skipped=True)
        else:
            t0 = clock()
            res = runner(part, out_root / part.name, min(left, part.estimate_s() * SLACK))
            res.seconds = clock() - t0
        tag = "SKIP" if res.skipped else "PASS" if res.ok else "FAIL"
        out(f"gpu-check: [{tag}] {res.name}: {res.detail}")
        results.append(res)
    return results
