"""The bench's side of the in-process limit: which inputs it runs, and running it.

The limit itself runs in a process of its own (``python -m producer.tools.bench.limit``, see
:mod:`producer.tools.bench.limit`); this module picks its inputs (the first repetition's measured
requests, or the planned schedule's when no service mode ran), writes its spec and reads
its output.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from producer.tools.bench.limit import default_batch_sizes
from producer.tools.bench.records import Record
from producer.tools.bench.results import BenchResult
from producer.tools.bench.schedule import open_schedule
from producer.tools.bench.sources import InputCatalog
from producer.tools.bench.workload import REPO, Workload
from shared.settings import load_settings


def used_sources(w: Workload) -> set[str]:
    """The sources the workload's phases draw from."""
    return {m.source for p in w.phases for m in p.mix}


def limit_items(
    w: Workload, catalog: InputCatalog, first_rep: list[Record] | None
) -> dict[str, list[list[Any]]]:
    """``[source, index]`` of the inputs to run per modality, in send order, capped at
    ``[limit] max_inputs``: those of ``first_rep``'s measured requests, else the schedule's."""
    if first_rep:
        recs = sorted((r for r in first_rep if r.measured), key=lambda r: r.sched_ms)
        pairs = [(r.modality, [r.source, r.input_index]) for r in recs]
    else:  # limit alone: the planned schedule's measured requests
        modality_of = {k: catalog.modality(k) for k in used_sources(w)}
        pairs = [
            (p.modality, [p.source, p.input_index])
            for p in open_schedule(w, modality_of)
            if p.measured
        ]
    out: dict[str, list[list[Any]]] = {}
    for m, item in pairs:
        lst = out.setdefault(m, [])
        if len(lst) < w.limit.max_inputs:
            lst.append(item)
    return out


def limit_into(
    res: BenchResult,
    w: Workload,
    catalog: InputCatalog,
    reps: int,
    stack: Any,
    rep: int | None = None,
) -> None:
    """Run the limit into ``res.limit`` (or ``res.limit_error``), on :func:`limit_items` of
    the fleet's first repetition (else the baseline's, else the schedule's).

    ``rep`` ``None``: all ``reps`` repetitions in one process. Else repetition ``rep`` of an
    interleaved run, a process of its own: the first sweeps the batch sizes; a later one
    times only the size the first chose and appends its throughput to ``throughput_reps``.
    """
    source = res.modes.get("fleet") or res.modes.get("baseline")
    items = limit_items(w, catalog, source.reps[0] if source is not None and source.reps else None)
    if not items:
        res.limit_error = "no measured inputs to run the limit on"
        return
    sizes = None
    if rep is not None and res.limit:
        sizes = {m: [int(r["best_batch_size"])] for m, r in res.limit.items()}
    tag = "" if rep is None else f"-{rep + 1}"
    n = reps if rep is None else 1
    out, err = run_limit(w, n, items, Path(res.run_dir), stack, sizes, tag)
    if out is None:
        res.limit_error = err
        return
    for m, r in out.items():
        if m in res.limit:
            res.limit[m]["throughput_reps"] += r["throughput_reps"]
        else:
            res.limit[m] = r


def run_limit(
    w: Workload,
    reps: int,
    items: dict[str, list[list[Any]]],
    run_dir: Path,
    stack: Any,
    batch_sizes: dict[str, list[int]] | None = None,
    tag: str = "",
) -> tuple[dict[str, Any] | None, str | None]:
    """Run the limit process on ``items``: ``(its output, None)`` or ``(None, why not)``.

    ``batch_sizes`` per modality replace the sweep's candidates. Its spec and output lie in
    ``run_dir`` (``limit-spec{tag}.json``, ``limit-out{tag}.json``); its log is
    ``limit.log`` in the stack's logs.
    """
    settings = load_settings()
    mods: dict[str, Any] = {}
    for m, its in items.items():
        cfg = settings.modality(m).batching
        sizes = (
            (batch_sizes or {}).get(m)
            or w.limit.batch_sizes.get(m)
            or default_batch_sizes(cfg.max_batch_size, cfg.preferred_batch_sizes)
        )
        mods[m] = {"items": its, "batch_sizes": sizes, "sweep_inputs": w.limit.sweep_inputs}
    spec_path, out_path = run_dir / f"limit-spec{tag}.json", run_dir / f"limit-out{tag}.json"
    used = used_sources(w)
    spec = {
        "repetitions": reps,
        "sources": {k: v.model_dump() for k, v in w.sources.items() if k in used},
        "modalities": mods,
    }
    spec_path.write_text(json.dumps(spec))
    log_path = stack.logs / "limit.log"
    argv = [sys.executable, "-m", "producer.tools.bench.limit", str(spec_path), str(out_path)]
    with open(log_path, "ab") as lf:
        proc = subprocess.run(argv, stdout=lf, stderr=subprocess.STDOUT, env=stack.env(),
                              cwd=str(REPO), check=False)  # fmt: skip
    if proc.returncode != 0 or not out_path.exists():
        return None, f"limit run failed (exit {proc.returncode}); see {log_path}"
    return json.loads(out_path.read_text()), None
