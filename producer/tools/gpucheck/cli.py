"""The command line: the device checks (skipped without CUDA), then the benches of
``benches.py`` under one time budget; print each, optionally save JSON.

``--parts`` picks what runs (default ``checks,overhead,text,image``). Without CUDA and with
``--parts`` left at its default the command prints :data:`SKIP_LINE` and exits 0, as a CPU
machine's ``make gpu-check`` always has; with ``--parts`` given it runs what needs no GPU (the
``overhead`` bench) and reports each CUDA part as skipped.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from producer.tools.gpucheck.benches import BUDGET_S, PARTS, PlanError, plan, run_parts
from producer.tools.gpucheck.checks import run_checks

__all__ = ["DEFAULT_PARTS", "SKIP_LINE", "main"]

SKIP_LINE = "gpu-check: skipped (no CUDA device)"
DEFAULT_PARTS = ("checks", *PARTS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m producer.tools.gpucheck",
        description="Check the device runtime and bench the fleet on a CUDA machine.",
    )
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here")
    parser.add_argument(
        "--parts",
        default=None,
        help=f"comma list of {', '.join(DEFAULT_PARTS)} (default: all of them)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help=f"seconds the whole check may take (default {BUDGET_S:.0f})",
    )
    parser.add_argument(
        "--bench-dir", type=Path, default=Path("reports/gpucheck"), help="the benches' reports"
    )
    args = parser.parse_args(argv)
    parts = tuple(x for x in (args.parts or ",".join(DEFAULT_PARTS)).split(",") if x)

    import torch

    # is_available() does not create a CUDA context here: the checks run in spawned children.
    cuda = torch.cuda.is_available()
    if not cuda and args.parts is None:
        print(SKIP_LINE, flush=True)
        return 0
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    try:
        planned = plan(
            [p for p in parts if p != "checks"],
            args.budget_s,
            device_checks="checks" in parts and cuda,
            cuda=cuda,
        )
    except PlanError as exc:
        parser.error(str(exc))
    if cuda:
        print(
            f"gpu-check: torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"{torch.cuda.device_count()} device(s); budget {args.budget_s:.0f} s",
            flush=True,
        )
    else:
        print("gpu-check: no CUDA device: the CUDA parts are skipped", flush=True)
    results: list = []
    if "checks" in parts:
        if cuda:
            results += run_checks(out=lambda s: print(s, flush=True))
        else:
            print("gpu-check: [SKIP] device checks: no CUDA device", flush=True)
    results += run_parts(planned, deadline, args.bench_dir, out=lambda s: print(s, flush=True))
    total = time.monotonic() - t0
    ran = [r for r in results if not getattr(r, "skipped", False)]
    passed = sum(r.ok for r in ran)
    print(
        f"gpu-check: {passed}/{len(ran)} passed, {len(results) - len(ran)} skipped "
        f"in {total:.1f} s",
        flush=True,
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "total_s": total,
                    "budget_s": args.budget_s,
                    "cuda": cuda,
                    "checks": [asdict(r) for r in results],
                },
                indent=2,
                default=str,
            )
            + "\n"
        )
    return 0 if passed == len(ran) else 1
