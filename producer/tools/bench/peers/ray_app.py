"""The ``ray-serve`` peer: one Ray Serve deployment with ``@serve.batch``, over its HTTP proxy.

What a user who wants batching without a queue picks instead of this product: the same
model code (:class:`~producer.tools.bench.peers.model.BatchModel`), batched by
``@serve.batch(max_batch_size, batch_wait_timeout_s)`` with the fleet's ``max_batch_size``
and ``max_queue_delay_ms``, 1 replica on 1 CPU, ``max_ongoing_requests`` as large as the
fleet's prefetch window (Ray's default of 5 would never let a batch fill). The batch runs in
a thread (``asyncio.to_thread``) so the replica keeps accepting requests while the model
runs, as the fleet's inference thread does. Requests are POSTed to ``/infer`` as
``{"request": <envelope>}``; the answer is ``{"result": ...}`` or ``{"error": {...}}``.

Run in the peer venv (``make peers``) by the bench::

    FLEET_WORKER_MODALITY=text .venv-peers/bin/python -m producer.tools.bench.peers.ray_app --port P

It prints ``PEER READY`` once the route answers, and runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
from typing import Any

ROUTE = "/infer"


def build_app(modality: str, max_batch_size: int, wait_s: float, max_ongoing: int) -> Any:
    """The bound Serve application (imports Ray lazily: only the peer venv has it)."""
    from ray import serve
    from starlette.requests import Request

    @serve.deployment(
        num_replicas=1, ray_actor_options={"num_cpus": 1}, max_ongoing_requests=max_ongoing
    )
    class Infer:
        def __init__(self) -> None:
            from producer.tools.bench.peers.model import BatchModel

            self.model = BatchModel(modality)

        @serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=wait_s)
        async def batch(self, envelopes: list[dict[str, Any]]) -> list[dict[str, Any]]:
            outcomes = await asyncio.to_thread(self.model.run, envelopes)
            return [o.to_json() for o in outcomes]

        async def __call__(self, request: Request) -> dict[str, Any]:
            body = await request.json()
            return await self.batch(body.get("request"))

    return Infer.bind()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    args = p.parse_args(argv)

    import ray
    from ray import serve

    from shared.settings import load_settings

    modality = os.environ.get("FLEET_WORKER_MODALITY", "text")
    cfg = load_settings().modality(modality)
    window = cfg.device.prefetch_multiplier
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build_app(
        modality,
        cfg.batching.max_batch_size,
        max(cfg.batching.max_queue_delay_ms, 1.0) / 1000.0,
        max(window, cfg.batching.max_batch_size),
    )
    serve.run(app, name=f"peer-{modality}", route_prefix=ROUTE)
    print("PEER READY", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
