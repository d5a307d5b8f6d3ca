"""Entry point of ``fleet bench``: load the workload, run it, write and print the report.

A workload with a ``tensor`` source (``transport``) runs ``producer/tools/bench/transport.py``
instead of the fleet/baseline/limit modes (``--modes`` does not apply to it), and one with
``runner = "submit-rate"`` runs ``producer/tools/bench/submitrate.py`` (the producer's enqueue
rate against raw Redis pipelines; ``--repetitions`` gives its rounds); one with ``runner =
"tenant-fairness"`` runs ``producer/tools/bench/fairness.py`` (tenants' fair share against
FIFO, one sitting; ``--modes`` does not apply). With
``metrics_cost`` (``--metrics-cost``) the run is ``producer/tools/bench/metricscost.py`` instead:
the fleet mode with metrics and tracing on vs off, interleaved (``--modes`` and
``--repetitions`` do not apply: one repetition per round and variant). A workload's ``modes``
replace ``--modes`` when it is left at its default (``fleet,baseline,limit``).

Exit codes: 0 the run completed (its warnings are in the report) or the workload is a
documented placeholder and was skipped; 1 the workload is invalid or the bench could not run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from producer.tools.bench.runner import ALL_MODES, MODES, Bench, BenchError, BenchOptions
from producer.tools.bench.sources import SourceError
from producer.tools.bench.workload import WorkloadError, list_workloads, load_workload

if TYPE_CHECKING:
    from producer.tools.bench.metricscost import CostOptions


def main(
    workload: str,
    repetitions: int = 0,
    modes: str = ",".join(MODES),
    out_dir: Path = Path("reports/bench"),
    plot: bool = True,
    run_dir: Path | None = None,
    metrics_cost: CostOptions | None = None,
    interleave: bool = True,
) -> int:
    """Run one workload; see the module docstring for exit codes."""
    err = Console(stderr=True)
    try:
        w = load_workload(workload)
    except WorkloadError as exc:
        err.print(f"[red]bench:[/red] {exc}")
        return 1
    if not w.runnable:
        err.print(f"bench: workload {w.name!r} skipped: {w.skip_reason}")
        return 0
    from producer.tools.bench.transport import is_transport, run_transport

    if is_transport(w):  # its own runner: tensors to the probe task, not modes
        return run_transport(w, repetitions, out_dir, run_dir.resolve() if run_dir else None, err)
    if w.runner == "submit-rate":  # its own runner: the producer's enqueue rate, not modes
        from producer.tools.bench.submitrate import run_submit_rate

        return run_submit_rate(w, repetitions, out_dir, run_dir.resolve() if run_dir else None, err)
    if w.runner == "tenant-fairness":  # its own runner: fair share vs FIFO, not modes
        from producer.tools.bench.fairness import run_fairness

        return run_fairness(w, out_dir, run_dir.resolve() if run_dir else None, err, repetitions)
    if modes == ",".join(MODES) and w.modes:  # --modes left at its default
        modes = ",".join(w.modes)
    wanted = tuple(m for m in modes.split(",") if m)
    unknown = [m for m in wanted if m not in ALL_MODES]
    if unknown or not wanted:
        err.print(f"[red]bench:[/red] --modes takes a comma list of {', '.join(ALL_MODES)}")
        return 1
    from producer.tools.bench.report import build_report, write_report
    from producer.tools.bench.tables import print_report

    opts = BenchOptions(
        w,
        wanted,
        repetitions,
        run_dir=run_dir.resolve() if run_dir else None,
        interleave=interleave,
    )
    try:
        if metrics_cost is not None:
            from producer.tools.bench.metricscost import CostBench

            result = CostBench(opts, metrics_cost, console=err).run()
        else:
            result = Bench(opts, console=err).run()
    except (BenchError, SourceError) as exc:
        err.print(f"[red]bench failed:[/red] {exc}")
        return 1
    report = build_report(result)
    # A cost run has no fleet/baseline/limit for the plot to draw.
    write_report(report, out_dir, plot=plot and metrics_cost is None)
    print_report(report, Console(file=sys.stdout, width=150))
    return 0


def names() -> list[str]:
    return list_workloads()
