"""``stack.json``: the addresses the running stack was started with (Redis, Flower, gateway,
metrics), so that later commands without the same ``FLEET_*`` variables find it.

:class:`StackState` is mixed into :class:`producer.stack.local.Stack`. Import these names from
``producer.stack.local``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.settings import Settings

__all__ = ["STATE_FILE", "StackState"]

STATE_FILE = "stack.json"


class StackState:
    """Writing and reading ``stack.json`` (mixed into :class:`producer.stack.local.Stack`: reads its
    settings ``s``, run directory ``dir`` and, to trust a record, ``status()``)."""

    if TYPE_CHECKING:
        s: Settings
        dir: Path

        def status(self) -> dict[str, bool]: ...

    def recorded(self) -> dict[str, dict[str, Any]]:
        """The addresses ``stack.json`` records, from these settings."""
        s = self.s
        return {
            "redis": {
                "host": s.redis.host,
                "port": s.redis.port,
                "db": s.redis.db,
                **({"sentinels": list(s.redis.sentinels)} if s.ha else {}),
            },
            "flower": {"host": s.flower.host, "port": s.flower.port},
            "gateway": {"host": s.gateway.host, "port": s.gateway.port},
            "metrics": {
                "host": s.metrics.host,
                "port_base": s.metrics.port_base,
                "exporter_host": s.metrics.exporter_host,
                "exporter_port": s.metrics.exporter_port,
            },
        }

    def recorded_env(self) -> dict[str, str]:
        """:meth:`recorded` as ``FLEET_<SECTION>__<KEY>`` variables."""
        return {
            f"FLEET_{section.upper()}__{key.upper()}": (
                json.dumps(value) if isinstance(value, list) else str(value)
            )
            for section, values in self.recorded().items()
            for key, value in values.items()
        }

    def write_state(self) -> None:
        """Record the addresses this stack was started with in ``stack.json``."""
        path = self.dir / STATE_FILE
        path.write_text(json.dumps(self.recorded(), indent=1))

    def read_state(self) -> dict[str, Any] | None:
        """The recorded addresses of the running stack; ``None`` when no stack process of
        this run dir is alive (a record left by an earlier stack is not trusted)."""
        path = self.dir / STATE_FILE
        if not path.is_file() or not any(self.status().values()):
            return None
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return state if isinstance(state, dict) else None
