"""Entry point of ``fleet chaos``: choose scenarios, run them, print the table."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from producer.tools.chaos.runner import RECOVER_LIMIT_S, Options, misses, run
from producer.tools.chaos.scenarios import ScenarioError, load_scenarios, select

COLUMNS = ("name", "sent", "completed", "lost", "duplicated_results", "duplicated_executions",
           "recover_s", "worker_restart_s", "worker_exited")  # fmt: skip


def main(file: Path, names: list[str], short: bool, video: bool, out: Path) -> int:
    """See ``fleet chaos --help`` for the exit codes."""
    console = Console(stderr=True)
    try:
        cf = load_scenarios(file)
        chosen = select(cf, names, short, with_video=video and not short)
    except ScenarioError as exc:
        console.print(f"[red]chaos:[/red] {exc}")
        return 2
    opts = Options(chosen, cf.load, with_video=video and not short, out=out, say=console.print)
    report = run(opts)
    table = Table(title=f"fleet chaos ({out})")
    for c in COLUMNS:
        table.add_column(c)
    for r in report["scenarios"]:
        table.add_row(*(str(r[c]) for c in COLUMNS))
    Console(width=200).print(table)
    failed = misses(report)
    for name, what in failed.items():
        console.print(f"[red]MISSED[/red] {name}: {', '.join(what)}")
    if not failed:
        console.print(
            f"every scenario: 0 lost, 0 duplicated results, final within {RECOVER_LIMIT_S} s"
        )
    return 1 if failed else 0
