"""Replicas and ports of the local stack, and stacks of their own on free ports (see
``producer.stack.local``). No processes are started here.

A replica ``N`` of a modality is node ``<modality>-N@<host>`` (replica 0: ``<modality>@<host>``),
process ``worker-<modality>-N`` (pidfile and log of that name), metrics port
:func:`replica_metrics_port`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path

from shared.settings import MODALITIES, Settings


def parse_replicas(spec: str) -> dict[str, int]:
    """``"text=2,image=1"`` -> ``{"text": 2, "image": 1}``; a bare ``text`` means 1.

    Raises:
        ValueError: an unknown modality, a count that is not an integer from 1 to 16, or a
            modality named twice.
    """
    out: dict[str, int] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, _, count = part.partition("=")
        name = name.strip()
        if name not in MODALITIES:
            raise ValueError(
                f"unknown modality {name!r} in --replicas; expected <modality>=<count> with "
                f"a modality of {', '.join(MODALITIES)} (e.g. text=2,image=1)"
            )
        if name in out:
            raise ValueError(f"{name!r} is named twice in --replicas")
        try:
            n = int(count) if count.strip() else 1
        except ValueError:
            raise ValueError(f"--replicas {part!r}: the count must be an integer") from None
        if not 1 <= n <= 16:
            raise ValueError(f"--replicas {part!r}: the count must be from 1 to 16")
        out[name] = n
    return out


def replica_metrics_port(base: int, modality: str, instance: int = 0) -> int | None:
    """The metrics port of replica ``instance`` of ``modality``: ``base + 4 * instance +
    modality index`` (text 0, image 1, video 2, xmodal 3), so replica 0 keeps the ports of
    a one-replica stack (9101-9104) and replica 1 takes the next block (9105-9108). ``None``
    when ``base`` is 0 (metrics off)."""
    if not base:
        return None
    return base + len(MODALITIES) * instance + MODALITIES.index(modality)


def replica_metrics_base(base: int, instance: int) -> int:
    """The ``[metrics] port_base`` a replica's process runs with, so that the worker's own
    ``base + modality index`` is :func:`replica_metrics_port`; 0 stays 0 (off)."""
    return base + len(MODALITIES) * instance if base else 0


def port_in_use(host: str, port: int) -> bool:
    """Whether a listening socket holds ``host:port`` right now (a bind with ``SO_REUSEADDR``,
    as Redis and uvicorn bind, fails with "address in use"; TIME_WAIT leftovers do not)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def port_problem(planned: Sequence[tuple[str, str, int, str, str]]) -> str | None:
    """The first port of ``planned`` (``(process, host, port, what, setting)``) that is taken
    or planned twice, as one line naming it, what needs it and the variable that moves it;
    ``None`` when all are free."""
    seen: dict[int, str] = {}
    for _name, host, port, what, setting in planned:
        hint = setting.split(" ")[0]
        if port in seen:
            return (
                f"port {port} is planned twice: for {seen[port]} and {what}; move one with {hint}"
            )
        seen[port] = what
        if port_in_use(host, port):
            alt = {"Flower": " (or --no-flower)", "the HTTP gateway": " (or --no-gateway)"}
            return (
                f"port {port} on {host} is already in use (needed by {what}); stop what holds "
                f"it, or choose another port: {hint}=<port> fleet up{alt.get(what, '')}"
            )
    return None


def free_port() -> int:
    """A TCP port free on loopback right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def isolated_environment(run_dir: Path, extra: dict[str, str] | None = None) -> Iterator[Settings]:
    """``FLEET_*`` variables for a stack of its own: run dir, free Redis and Flower ports,
    metrics and the exporter off (so it never collides with a ``make up`` stack on this
    host); ``extra`` wins.
    Yields the settings so built; restores the environment afterwards.
    """
    from shared.settings import load_settings

    env = {
        "FLEET_STACK__RUN_DIR": str(run_dir),
        "FLEET_REDIS__PORT": str(free_port()),
        "FLEET_FLOWER__PORT": str(free_port()),
        "FLEET_GATEWAY__PORT": str(free_port()),
        "FLEET_METRICS__PORT_BASE": "0",
        "FLEET_METRICS__EXPORTER_PORT": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **(extra or {}),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield load_settings()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
