"""``make precision``: a reduced-precision text model measured against fp32, in-process.

Loads the text adapter twice in this process (``fp32`` and ``--precision``, default
``int8``; the same code a worker runs, ``[models.<name>]`` settings and ``FLEET_*``
overrides applied), embeds every sentence of ``data/text/botchan_sentences.txt`` with both
and reports, as JSON on stdout and in ``reports/precision.json``:

- ``cosine``: per-text cosine similarity of the two embeddings (both unit length): mean,
  min, p01, and the five worst texts' lengths; the int8 calibration texts are another
  corpus (``workers/models/calibration``), so this is not measured on what was calibrated;
- ``semantic_check``: the demo's check (related captions closer than unrelated ones) on the
  reduced model's embeddings;
- ``throughput_rps``: each model's in-process rate over the same texts, sorted by length
  into batches of ``max_batch_size`` (the bench's ``limit`` method), best of ``--reps``;
  ``speedup`` = reduced / fp32.

Usage: ``python -m producer.tools.bench.precision [--precision int8] [--reps 3] [--limit N]``.
Exit code 0 when the quality targets hold (mean >= 0.99, min >= 0.97, semantic check), 1
otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from producer.tools.bench.workload import REPO

TEXTS = REPO / "data" / "text" / "botchan_sentences.txt"
MEAN_TARGET, MIN_TARGET = 0.99, 0.97


def _adapter(precision: str) -> Any:
    from shared.settings import load_settings
    from workers.models import make_adapter
    from workers.models.runtime import DeviceRuntime

    base = load_settings()
    name = base.modality("text").model
    entry = {**base.models[name].model_dump(), "precision": precision}
    settings = load_settings(models={name: entry})
    runtime = DeviceRuntime(settings.modality("text").device)
    runtime.start()
    adapter = make_adapter("text", settings, runtime)
    adapter.load()
    return adapter, runtime, settings.modality("text").batching.max_batch_size


def embed(adapter: Any, runtime: Any, texts: list[str], batch: int) -> tuple[np.ndarray, float]:
    """``(embeddings [n, dim] float32 in input order, seconds)`` over length-sorted batches."""
    samples = [adapter.preprocess(adapter.prepare({"text": t})) for t in texts]
    order = sorted(range(len(samples)), key=lambda i: len(samples[i][0]))
    out: list[Any] = [None] * len(samples)
    t0 = time.perf_counter()
    for k in range(0, len(order), batch):
        idx = order[k : k + batch]
        with runtime.batch_context():
            results = adapter.run_batch([samples[i] for i in idx])
        for i, r in zip(idx, results, strict=True):
            out[i] = r["embedding"]
    return np.asarray(out, dtype=np.float32), time.perf_counter() - t0


def measure(precision: str, reps: int, limit: int | None) -> dict[str, Any]:
    """The report described in the module docstring."""
    from producer.tools.demo.semantic import caption_groups, text_check

    texts = [t for t in TEXTS.read_text(encoding="utf-8").splitlines() if t.strip()]
    texts = texts[:limit] if limit else texts
    captions = sorted({c for g in caption_groups() for c in g} | set(_SEMANTIC_EXTRA))
    out: dict[str, Any] = {"precision": precision, "texts": len(texts), "source": str(TEXTS)}
    embs: dict[str, np.ndarray] = {}
    rps: dict[str, float] = {}
    for prec in ("fp32", precision):
        adapter, runtime, batch = _adapter(prec)
        out.setdefault("model", adapter.describe())
        out[f"{prec}_facts"] = adapter.describe()
        best = 0.0
        for _ in range(max(reps, 1)):
            e, secs = embed(adapter, runtime, texts, batch)
            best = max(best, len(texts) / secs)
        embs[prec], rps[prec] = e, best
        if prec == precision:
            cap, _ = embed(adapter, runtime, captions, batch)
            out["semantic_check"] = text_check(dict(zip(captions, cap.tolist(), strict=True)))
        out["max_batch_size"] = batch
    cos = (embs["fp32"] * embs[precision]).sum(1)
    worst = np.argsort(cos)[:5]
    out["cosine"] = {
        "mean": float(cos.mean()),
        "min": float(cos.min()),
        "p01": float(np.percentile(cos, 1)),
        "worst": [{"cos": float(cos[i]), "chars": len(texts[i])} for i in worst],
    }
    out["throughput_rps"] = rps
    out["speedup"] = rps[precision] / rps["fp32"]
    out["targets"] = {"mean": MEAN_TARGET, "min": MIN_TARGET}
    out["met"] = bool(
        cos.mean() >= MEAN_TARGET and cos.min() >= MIN_TARGET and out["semantic_check"]["passed"]
    )
    return out


_SEMANTIC_EXTRA = (
    "A man is playing a guitar.",
    "Someone is playing an instrument.",
    "The stock market fell sharply today.",
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", default="int8")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--limit", type=int, default=None, help="only the first N texts")
    p.add_argument("--out", type=Path, default=REPO / "reports" / "precision.json")
    args = p.parse_args(argv)
    rep = measure(args.precision, args.reps, args.limit)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rep, indent=2))
    c = rep["cosine"]
    print(json.dumps(rep, indent=2))
    print(
        f"{args.precision} vs fp32 over {rep['texts']} texts: cosine mean {c['mean']:.4f} "
        f"min {c['min']:.4f} p01 {c['p01']:.4f}; semantic check "
        f"{'passed' if rep['semantic_check']['passed'] else 'FAILED'}; throughput "
        f"{rep['throughput_rps']['fp32']:.1f} -> {rep['throughput_rps'][args.precision]:.1f} "
        f"texts/s ({rep['speedup']:.2f}x); targets {'met' if rep['met'] else 'NOT met'}",
        file=sys.stderr,
    )
    return 0 if rep["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
