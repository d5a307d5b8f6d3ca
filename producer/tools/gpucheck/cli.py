"""The command line: skip without CUDA, else run the checks, print them, optionally save JSON."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from producer.tools.gpucheck.checks import run_checks

__all__ = ["SKIP_LINE", "main"]

SKIP_LINE = "gpu-check: skipped (no CUDA device)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m producer.tools.gpucheck",
        description="Check the device runtime on a CUDA machine (skips without CUDA).",
    )
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args(argv)

    import torch

    # is_available() does not create a CUDA context here: the checks run in spawned children.
    if not torch.cuda.is_available():
        print(SKIP_LINE, flush=True)
        return 0
    t0 = time.monotonic()
    print(
        f"gpu-check: torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"{torch.cuda.device_count()} device(s)",
        flush=True,
    )
    results = run_checks(out=lambda s: print(s, flush=True))
    total = time.monotonic() - t0
    passed = sum(r.ok for r in results)
    print(f"gpu-check: {passed}/{len(results)} checks passed in {total:.1f} s", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"total_s": total, "checks": [asdict(r) for r in results]}, indent=2, default=str
            )
            + "\n"
        )
    return 0 if passed == len(results) else 1
