"""The in-process limit: the same model, called in a loop, no queue, doing the best it can.

Run as ``python -m producer.tools.bench.limit SPEC.json OUT.json`` in a process of its own (the
bench's producer never imports torch, and the limit must not share a process with anything).
For each modality in the spec it builds the worker's own adapter and device runtime (same
model, same ``torch_threads``, same ``batch_context``), and times the full per-request work a
worker does: ``prepare`` (validation, tokenization, header read) and ``preprocess`` (image
decode) for every input, then ``run_batch`` over batches formed the best way known:

- inputs sorted by bucket, then by length, so a text batch pads only to neighbours of its
  own length (unsorted batches pad to the longest of a random draw, which on this model
  costs about half the throughput: the limit would understate the ceiling);
- every candidate batch size swept on ``sweep_inputs`` inputs, the fastest kept;
- then ``repetitions`` timed passes over the workload's own measured inputs (up to
  ``max_inputs``) at that size.

Spec (JSON)::

    {"repetitions": 3, "sources": {<name>: <SourceSpec>},
     "modalities": {"text": {"items": [[source, index], ...], "batch_sizes": [1, 8, 32],
                             "sweep_inputs": 256}}}

Output: per modality ``throughput_reps`` (requests/s), ``best_batch_size``, ``sweep_rps``
(by batch size), ``unsorted_rps`` (best size, no sorting; texts only), ``errors``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from producer.tools.bench.workload import SourceSpec


def sorted_batches(keys: Sequence[tuple[str, int]], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches: by bucket, sorted by length inside it, ``batch_size`` each.

    Args:
        keys: ``(bucket, length)`` per input.

    Raises:
        ValueError: ``batch_size`` is not positive.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be positive")
    by_bucket: dict[str, list[int]] = {}
    for i, (bucket, _) in enumerate(keys):
        by_bucket.setdefault(bucket, []).append(i)
    out: list[list[int]] = []
    for bucket in sorted(by_bucket):
        idx = sorted(by_bucket[bucket], key=lambda i: keys[i][1])
        out.extend(idx[k : k + batch_size] for k in range(0, len(idx), batch_size))
    return out


def arrival_batches(n: int, batch_size: int) -> list[list[int]]:
    """Indices in arrival order, ``batch_size`` each (the unsorted comparison)."""
    return [list(range(k, min(k + batch_size, n))) for k in range(0, n, batch_size)]


def default_batch_sizes(max_batch_size: int, preferred: Sequence[int]) -> list[int]:
    """1, the preferred sizes and the max, without duplicates, ascending, capped at the max."""
    return sorted({1, max_batch_size, *(b for b in preferred if 1 <= b <= max_batch_size)})


class LoadedAdapter:
    """One modality's adapter and device runtime, loaded in this process (the worker's own
    code: ``make_adapter`` + ``load`` on a started ``DeviceRuntime``).

    Args:
        modality: ``text``, ``image``, ...
        settings: fleet settings (default: from the environment, ``FLEET_*``).
    """

    def __init__(self, modality: str, settings: Any = None) -> None:
        from shared.settings import load_settings
        from workers.models import make_adapter
        from workers.models.runtime import DeviceRuntime

        self.modality = modality
        self.settings = settings or load_settings()
        self.cfg = self.settings.modality(modality)
        self.runtime = DeviceRuntime(self.cfg.device)
        self.runtime.start()
        t0 = time.perf_counter()
        self.adapter = make_adapter(modality, self.settings, self.runtime)
        self.adapter.load()
        self.load_s = time.perf_counter() - t0


class LimitRunner(LoadedAdapter):
    """One modality's adapter, loaded in this process, timed over lists of inputs."""

    def timed_pass(
        self,
        inputs: Sequence[dict[str, Any]],
        batch_size: int,
        batching: Callable[..., list[list[int]]] | None = None,
    ) -> tuple[float, int, int]:
        """Prepare, batch and run every input once: ``(seconds, ok, errors)``.

        ``batching(keys, batch_size)`` forms the batches; default :func:`sorted_batches`.
        """
        from shared.errors import FleetError

        t0 = time.perf_counter()
        prepared = []
        errors = 0
        for x in inputs:
            try:
                prepared.append(self.adapter.prepare(x))
            except FleetError:
                errors += 1
        keys = [(p.bucket, p.length) for p in prepared]
        if batching is None:
            groups = sorted_batches(keys, batch_size)
        else:
            groups = batching(len(keys), batch_size)
        ok = 0
        outputs: list[dict[str, Any]] = []  # their /dev/shm segments released after timing
        for group in groups:
            samples = []
            for i in group:
                try:
                    samples.append(self.adapter.preprocess(prepared[i]))
                except FleetError:
                    errors += 1
            if not samples:
                continue
            with self.runtime.batch_context():
                outputs.extend(self.adapter.run_batch(samples))
            ok += len(samples)
        elapsed = time.perf_counter() - t0
        self.adapter.discard(outputs)
        return elapsed, ok, errors

    def lengths(self, inputs: Sequence[dict[str, Any]]) -> set[int]:
        """Distinct prepared lengths of the valid ``inputs``."""
        from shared.errors import FleetError

        out = set()
        for x in inputs:
            try:
                out.add(self.adapter.prepare(x).length)
            except FleetError:
                continue
        return out

    def rps(self, inputs: Sequence[dict[str, Any]], batch_size: int, **kw: Any) -> float:
        seconds, ok, _ = self.timed_pass(inputs, batch_size, **kw)
        return ok / seconds if seconds > 0 else 0.0


def measure(
    runner: LimitRunner,
    inputs: list[dict[str, Any]],
    batch_sizes: Sequence[int],
    sweep_inputs: int,
    repetitions: int,
    log: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """Sweep batch sizes, keep the fastest, then time ``repetitions`` full passes."""
    sweep_set = inputs[:sweep_inputs]
    sweep: dict[str, float] = {}
    for bs in batch_sizes:
        runner.timed_pass(sweep_set[: max(bs, 1) * 2], bs)  # warm this shape
        sweep[str(bs)] = runner.rps(sweep_set, bs)
        log(f"limit {runner.modality}: batch {bs}: {sweep[str(bs)]:.1f} req/s")
    best = int(max(sweep, key=lambda k: sweep[k]))
    unsorted = None
    if len(runner.lengths(sweep_set[:64])) > 1:
        unsorted = runner.rps(sweep_set, best, batching=arrival_batches)
    reps = []
    errors = 0
    for k in range(repetitions):
        seconds, ok, err = runner.timed_pass(inputs, best)
        reps.append(ok / seconds if seconds > 0 else 0.0)
        errors = err
        log(f"limit {runner.modality}: repetition {k + 1}/{repetitions}: {reps[-1]:.1f} req/s")
    return {
        "throughput_reps": reps,
        "best_batch_size": best,
        "sweep_rps": sweep,
        "unsorted_rps": unsorted,
        "inputs": len(inputs),
        "errors": errors,
        "load_s": runner.load_s,
        "torch_threads": runner.runtime.stats()["torch_threads"],
        "device": str(runner.runtime.device),
    }


def main(argv: Sequence[str]) -> int:
    """``python -m producer.tools.bench.limit SPEC.json OUT.json``; progress lines on stderr."""
    from producer.tools.bench.sources import InputCatalog

    spec = json.loads(Path(argv[0]).read_text())
    sources = {k: SourceSpec.model_validate(v) for k, v in spec["sources"].items()}
    catalog = InputCatalog(sources)
    out: dict[str, Any] = {}

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    for modality, m in spec["modalities"].items():
        inputs = [catalog.get(s, i) for s, i in m["items"]]
        runner = LimitRunner(modality)
        log(f"limit {modality}: model loaded in {runner.load_s:.1f} s; {len(inputs)} inputs")
        out[modality] = measure(
            runner,
            inputs,
            m["batch_sizes"],
            int(m["sweep_inputs"]),
            int(spec["repetitions"]),
            log,
        )
        del runner
    Path(argv[1]).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
