"""``python -m producer.tools.bench.coldstart``: what a Kubernetes autoscaler needs to know about a
worker, measured on a stack of its own (fresh Redis, free ports, metrics on a free port).

For each modality, one after another (so a load does not share the CPU with another):

- **cold start**: a fresh ``fleet worker <modality>`` process is spawned; ``ready_s`` is spawn
  until its metrics port answers ``GET /metrics`` with 200 (the signal the manifests' startup
  and readiness probes read: the worker opens it only after model load and warmup);
  ``first_result_s`` is spawn until the first request, sent at ``ready_s``, has its result.
- **service rate**: ``burst`` requests enqueued at once on the warm worker (BULK, no
  deadline); ``rate_per_s`` = requests / (last result - first send). That is the drain rate
  of one replica with a full prefetch window, what a KEDA target per replica divides.

Writes one JSON object (``--out``, and stdout)::

    {"machine": {...}, "modalities": {m: {"ready_s", "first_result_s",
     "burst", "rate_per_s", "errors"}}}

Inputs are the repo's own data (data/text, data/images, data/videos).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from producer.client import FleetClient, SubmitRequest, image_inputs, xmodal_inputs
from producer.stack.local import Stack, free_port, isolated_environment
from shared.settings import MODALITIES

REPO = Path(__file__).resolve().parents[3]
SHM_ROOT = Path("/dev/shm") / f"mmfleet-bench-{os.getpid()}"
DEFAULT_BURST = {"text": 2000, "image": 200, "video": 12, "xmodal": 100}


def _inputs(client: FleetClient, modality: str, i: int) -> dict[str, Any]:
    """The ``i``-th request's inputs for ``modality`` (cycling over the repo's data)."""
    if modality == "text":
        lines = (REPO / "data/text/botchan_sentences.txt").read_text().splitlines()
        texts = [t for t in lines if t.strip()]
        return {"text": texts[i % len(texts)]}
    images = sorted((REPO / "data/images").glob("detectron_*.jpg"))
    if modality == "image":
        return image_inputs(images[i % len(images)])
    if modality == "xmodal":
        return xmodal_inputs(images[i % len(images)], ["a photo", "a drawing", "a street"])
    return client.video_inputs(REPO / "data/videos/torchcodec_nasa_13013.mp4")


def _metrics_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def measure(modality: str, burst: int, workdir: Path, timeout_s: float = 900.0) -> dict[str, Any]:
    """Cold start and service rate of one fresh ``modality`` worker (see the module doc).

    Raises:
        RuntimeError: the worker exited, or did not get ready within ``timeout_s``.
    """
    port = free_port()
    # The worker's port is port_base + the modality's index.
    base = port - MODALITIES.index(modality)
    overrides = {
        "FLEET_METRICS__PORT_BASE": str(base),
        "FLEET_TRANSPORT__SHARED_HOST": "false",
        # a /dev/shm root of its own, removed afterwards: another stack's is never touched
        "FLEET_TRANSPORT__SHM_ROOT": str(SHM_ROOT),
    }
    with isolated_environment(workdir / modality, overrides) as settings:
        stack = Stack(settings)
        stack.up([], flower=False)
        client = FleetClient(settings)
        try:
            name = stack.worker_name(modality)
            t0 = time.monotonic()
            stack._spawn(name, stack.worker_argv(modality))
            while not _metrics_ok(port):
                if not stack.alive(name) or time.monotonic() - t0 > timeout_s:
                    raise RuntimeError(f"{modality} worker not ready:\n{stack.log_tail(name)}")
                time.sleep(0.05)
            ready_s = time.monotonic() - t0
            first = client.submit(modality, _inputs(client, modality, 0), "bulk")
            first.get(timeout_s=timeout_s)
            first_result_s = time.monotonic() - t0
            reqs = [
                SubmitRequest(modality, _inputs(client, modality, i), "bulk") for i in range(burst)
            ]
            t1 = time.monotonic()
            handles = client.submit_many(reqs)
            outs = client.wait_all(handles, timeout_s=timeout_s)
            done_at = time.monotonic()
            errors = sum(1 for o in outs if o is None or "result" not in o)
            elapsed = done_at - t1
            return {
                "ready_s": round(ready_s, 2),
                "first_result_s": round(first_result_s, 2),
                "burst": burst,
                "rate_per_s": round(burst / elapsed, 1),
                "errors": errors,
            }
        finally:
            client.close()
            stack.down()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modalities", default="text,image", help="comma-separated")
    p.add_argument("--burst", type=int, default=0, help="requests per burst (0: per modality)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    mods = [m for m in args.modalities.split(",") if m]
    report: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": list(os.getloadavg()),
        },
        "modalities": {},
    }
    try:
        with tempfile.TemporaryDirectory(prefix="fleet-coldstart-") as tmp:
            for m in mods:
                burst = args.burst or DEFAULT_BURST[m]
                report["modalities"][m] = measure(m, burst, Path(tmp))
                print(m, report["modalities"][m], file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(SHM_ROOT, ignore_errors=True)
    report["machine"]["loadavg_after"] = list(os.getloadavg())
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
