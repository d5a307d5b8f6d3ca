"""The peers users would pick instead of this product, run by ``fleet bench`` beside it.

Two modes, each on the same Redis, model code, inputs and schedule as the fleet:

- ``celery-batches``: a Celery worker with a ``celery_batches.Batches`` task
  (:mod:`producer.tools.bench.peers.batches_app`); requests are published exactly as for the
  fleet (its priority lists included) and results collected from Redis.
- ``ray-serve``: a Ray Serve deployment with ``@serve.batch``
  (:mod:`producer.tools.bench.peers.ray_app`) driven over its HTTP proxy
  (:class:`~producer.tools.bench.peers.sender.RaySender`); it has no priorities.

Both run in a venv of their own (``make peers``: ``.venv-peers``, or the interpreter named by
``FLEET_BENCH_PEERS_PYTHON``): celery-batches requires ``celery<5.7``, which would downgrade
the fleet's Celery if installed beside it. A mode whose peer is not installed is skipped with
the reason printed, never failed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from producer.tools.bench.workload import REPO

__all__ = ["PEER_MODES", "PeerProcess", "peer_python", "start_peer", "unavailable_reason"]

PEER_MODES = ("celery-batches", "ray-serve")
_IMPORTS = {"celery-batches": "celery_batches", "ray-serve": "ray.serve"}
PEER_READY_TIMEOUT_S = 300.0


def peer_python() -> Path:
    """The peer venv's interpreter: ``FLEET_BENCH_PEERS_PYTHON`` or ``.venv-peers/bin/python``."""
    env = os.environ.get("FLEET_BENCH_PEERS_PYTHON")
    return Path(env) if env else REPO / ".venv-peers" / "bin" / "python"


def unavailable_reason(mode: str) -> str | None:
    """Why ``mode`` cannot run here (one line), or ``None`` when its peer is installed."""
    py = peer_python()
    if not py.exists():
        return f"{mode}: no peer venv at {py} (run `make peers`, or set FLEET_BENCH_PEERS_PYTHON)"
    probe = subprocess.run(
        [str(py), "-c", f"import {_IMPORTS[mode]}, producer.tools.bench.peers.model"],
        capture_output=True,
        text=True,
        cwd=str(REPO),
        check=False,
        timeout=120,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
        return f"{mode}: the peer venv {py} cannot import {_IMPORTS[mode]} ({last})"
    return None


class PeerProcess:
    """A started peer: its stack process name and, for ``ray-serve``, its HTTP address."""

    def __init__(self, name: str, url: str | None = None) -> None:
        self.name = name
        self.url = url


def start_peer(stack: Any, mode: str, modality: str, prefetch: int) -> PeerProcess:
    """Start ``mode``'s server for ``modality`` under ``stack`` and wait until it is ready.

    Args:
        stack: the bench's :class:`~producer.stack.local.Stack` (its env, logs and ``down``).
        prefetch: the fleet worker's prefetch window (celery-batches gets the same).

    Raises:
        StackError: the peer exited or was not ready within ``PEER_READY_TIMEOUT_S``.
    """
    env = {**stack.env(), "FLEET_WORKER_MODALITY": modality}
    name = f"peer-{mode}-{modality}"
    py = str(peer_python())
    if mode == "celery-batches":
        node = f"{modality}@{socket.gethostname()}"
        argv = [py, "-m", "celery", "-A", "producer.tools.bench.peers.batches_app", "worker",
                "-Q", modality, "-P", "threads", "-c", "1", f"--prefetch-multiplier={prefetch}",
                "-n", node, "--without-gossip", "--without-mingle", "-E",
                "--loglevel=INFO"]  # fmt: skip
        stack.start_process(
            name, argv, lambda: stack.worker_ping(node), PEER_READY_TIMEOUT_S, env=env
        )
        return PeerProcess(name)
    if mode == "ray-serve":
        from producer.stack.ports import free_port

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [py, "-m", "producer.tools.bench.peers.ray_app", "--port", str(port)]
        # serve.run returns (and the app prints its line) once the replica has loaded and
        # warmed; the proxy lists the route earlier, while the replica is still loading.
        stack.start_process(
            name,
            argv,
            lambda: "PEER READY" in stack.log_tail(name, 400) and _route_ready(url),
            PEER_READY_TIMEOUT_S,
            env=env,
        )
        return PeerProcess(name, url)
    raise ValueError(f"unknown peer mode {mode!r}; one of {PEER_MODES}")


def _route_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/routes", timeout=1.0) as r:
            return r.status == 200 and b"/infer" in r.read()
    except Exception:
        return False
