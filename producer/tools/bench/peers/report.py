"""The peers' lines of the bench's stdout report (the JSON carries them in ``modes``)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from producer.tools.bench.peers import PEER_MODES


def print_peers(report: dict[str, Any], con: Console) -> None:
    """Throughput of each peer that ran beside the fleet's, with the fleet's ratio to it."""
    ran = [p for p in PEER_MODES if report["modes"].get(p)]
    if not ran:
        return
    t = Table(title="Peers: requests/s, median (min-max); fleet/peer of medians")
    for col in ("modality", "fleet", *ran, *(f"fleet/{p}" for p in ran)):
        t.add_column(col, justify="left" if col == "modality" else "right")
    for m in sorted({m for mode in ("fleet", *ran) for m in report["modes"].get(mode, {})}):
        cells = []
        for mode in ("fleet", *ran):
            s = report["modes"].get(mode, {}).get(m)
            if not s or s["throughput_rps"] is None:
                cells.append("-")
                continue
            sp = s["throughput_spread"]
            cells.append(f"{s['throughput_rps']:.1f} ({sp['min']:.1f}-{sp['max']:.1f})")
        r = report["ratios"].get(m, {})
        for p in ran:
            v = r.get(f"fleet_over_{p}")
            cells.append("-" if v is None else f"{v:.2f}")
        t.add_row(m, *cells)
    con.print(t)
