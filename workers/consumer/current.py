"""The one engine of this worker process (a worker process owns exactly one device slot)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.consumer.engine import Engine

_engine: Engine | None = None


def install(engine: Engine) -> None:
    global _engine
    _engine = engine


def current() -> Engine:
    """The started engine.

    Raises:
        RuntimeError: no engine was started in this process (not a fleet worker).
    """
    if _engine is None:
        raise RuntimeError("no batching engine in this process; start it with `fleet worker`")
    return _engine
