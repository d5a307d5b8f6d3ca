"""Priority classes and their mapping to Celery priorities and deadlines.

Classes, highest first: REALTIME, HIGH, NORMAL, BULK. Lower number runs first, as in
Celery's Redis transport (one list per priority step, 0 served first, FIFO inside a step).
The Celery priority and the default timeout of each class come from ``[priorities.*]`` in
``configs/fleet.toml``; a per-request ``timeout_s`` overrides the class default.
"""

from __future__ import annotations

from enum import IntEnum

from shared.errors import InvalidPriority
from shared.settings import Settings

__all__ = ["Priority"]


class Priority(IntEnum):
    """A request's priority class; the int value orders classes (0 = most urgent)."""

    REALTIME = 0
    HIGH = 1
    NORMAL = 2
    BULK = 3

    @property
    def label(self) -> str:
        """Lower-case name used in configs, messages and metrics (``"realtime"``)."""
        return _LABELS[self]

    @classmethod
    def parse(cls, value: str | int | Priority) -> Priority:
        """Accept a class name (any case) or an existing :class:`Priority`.

        Raises:
            InvalidPriority: anything else, including bare Celery priority numbers: a caller
                must name a class so that timeouts and metrics stay meaningful.
        """
        if isinstance(value, Priority):
            return value
        found = _BY_LABEL.get(value) if type(value) is str else None  # the usual spelling
        if found is not None:
            return found
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        valid = ", ".join(p.label for p in cls)
        raise InvalidPriority(f"unknown priority {value!r}; expected one of: {valid}")

    def celery_priority(self, settings: Settings) -> int:
        """The Celery message priority (0-9, 0 first) configured for this class."""
        return settings.priorities[self.label].celery_priority

    def default_timeout_s(self, settings: Settings) -> float | None:
        """The class's default timeout in seconds, or ``None`` when the class has none."""
        t = settings.priorities[self.label].timeout_s
        return t if t > 0 else None


_LABELS = {p: p.name.lower() for p in Priority}
_BY_LABEL = {label: p for p, label in _LABELS.items()}
