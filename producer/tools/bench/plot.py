"""The bench plot: latency CDF per priority (fleet vs baseline and peers) and throughput bars.

One column per modality. Top: the empirical CDF of end-to-end latency (log scale, ms) per
priority class, fleet solid, baseline dashed, the peers (celery-batches, ray-serve) when they
ran in other styles, pooled over repetitions, over all measured requests: a curve ends below
1 by the share that failed or expired. Bottom: median throughput of each mode with min-max
error bars, and the in-process limit as a horizontal line. Matplotlib's Agg backend: no
display needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {"realtime": "#d62728", "high": "#ff7f0e", "normal": "#1f77b4", "bulk": "#7f7f7f"}
# Line style per mode in the CDF and bar colour in the throughput panel; peers when they ran.
STYLES = {"fleet": "-", "baseline": "--", "celery-batches": "-.", "ray-serve": (0, (1, 1))}
STYLE_NAMES = {"fleet": "solid", "baseline": "dashed", "celery-batches": "dash-dot",
               "ray-serve": "dense dots"}  # fmt: skip
BAR_COLORS = {"fleet": "#2ca02c", "baseline": "#9467bd", "celery-batches": "#8c564b",
              "ray-serve": "#e377c2"}  # fmt: skip


def _style_legend(report: dict[str, Any]) -> str:
    return ", ".join(f"{STYLE_NAMES[m]} {m}" for m in STYLES if report["modes"].get(m))


def plot_report(report: dict[str, Any], path: Path) -> Path:
    """Draw the report's ``cdf`` samples and throughputs into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    from producer.tools.bench.stats import ordered_priorities

    modalities = sorted(
        {m for mode in ("fleet", "baseline", "limit") for m in report["modes"].get(mode, {})}
    )
    ncols = max(len(modalities), 1)
    fig, axes = plt.subplots(2, ncols, figsize=(6 * ncols, 8), squeeze=False)
    cdf = report.get("cdf_ms", {})
    for col, m in enumerate(modalities):
        ax = axes[0][col]
        for mode, style in STYLES.items():
            series = cdf.get(mode, {}).get(m, {})
            for prio in ordered_priorities(series):
                g = series[prio]
                xs = g["values"]
                if not xs or not g["requests"]:
                    continue
                reach = g["ok"] / g["requests"]  # failed and expired requests never finish
                ys = [(i + 1) / len(xs) * reach for i in range(len(xs))]
                ax.step(xs, ys, where="post", linestyle=style, color=COLORS.get(prio, "black"),
                        label=f"{mode} {prio}")  # fmt: skip
        deadlines = report.get("deadlines", {}).get("fleet", {}).get(m, {})
        for prio, d in deadlines.items():
            if d.get("timeout_s"):
                ax.axvline(d["timeout_s"] * 1000.0, color=COLORS.get(prio, "black"),
                           linestyle=":", linewidth=1)  # fmt: skip
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("end-to-end latency from scheduled send (ms)")
        ax.set_ylabel("fraction of requests (errors never arrive)")
        ax.set_title(f"{m}: latency CDF\n({_style_legend(report)}, dotted deadlines)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        _throughput(axes[1][col], report, m)
    fig.suptitle(f"bench {report['workload']} ({report['repetitions']} repetitions)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _throughput(ax: Any, report: dict[str, Any], m: str) -> None:
    names, heights, lo, hi = [], [], [], []
    for mode in STYLES:
        s = report["modes"].get(mode, {}).get(m)
        if not s or s["throughput_rps"] is None:
            continue
        sp = s["throughput_spread"]
        names.append(mode)
        heights.append(s["throughput_rps"])
        lo.append(s["throughput_rps"] - sp["min"])
        hi.append(sp["max"] - s["throughput_rps"])
    ax.bar(names, heights, yerr=[lo, hi], capsize=6, color=[BAR_COLORS[n] for n in names])
    lim = report["modes"].get("limit", {}).get(m)
    if lim and lim.get("throughput_rps"):
        ax.axhline(lim["throughput_rps"], color="black", linestyle=":",
                   label=f"in-process limit {lim['throughput_rps']:.1f}/s "
                         f"(batch {lim.get('best_batch_size')})")  # fmt: skip
        ax.legend(fontsize=8)
    ax.set_ylabel("requests/s (median, min-max)")
    ax.set_title(f"{m}: throughput")
