"""The task envelope: what one inference request carries on the broker.

Each request is one Celery task (protocol 2, JSON body) named ``fleet.<modality>`` on the
queue of that modality, with a single keyword argument ``request`` holding the envelope::

    {"v": 1, "modality": "text", "priority": "realtime",
     "submitted_ms": 1764460800123.4, "deadline_ms": 1764460800323.4,
     "model": null, "inputs": {"text": "A man is playing a guitar."}}

Times are Unix epoch milliseconds on Redis' clock (``TIME``, ``shared.clock``), the one
clock producers and workers on different hosts share: a host whose own clock is off neither
fails nor keeps requests past their deadline. ``deadline_ms`` null means no deadline.
Inputs per modality:

- text: ``{"text": str}``
- image: ``{"image_b64": str}`` (base64 of JPEG/PNG/WebP/... file bytes)
- video / xmodal: see their adapters.

Large tensors travel as ``TensorRef`` objects (see ``shared.transport``), never as bytes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared import clock
from shared.errors import InvalidInput, UnsupportedModality
from shared.settings import MODALITIES

__all__ = ["ENVELOPE_KWARG", "TaskEnvelope"]

ENVELOPE_KWARG = "request"


class TaskEnvelope(BaseModel):
    """One inference request (frozen). See the module docstring for the wire format."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    v: Literal[1] = 1
    modality: str
    priority: str
    submitted_ms: float = Field(default_factory=lambda: clock.now_s() * 1000.0)
    deadline_ms: float | None = None
    model: str | None = None
    inputs: dict[str, Any]

    def expired(self, now_ms: float | None = None) -> bool:
        """True when a deadline is set and ``now_ms`` (default: now, on this process's
        clock: Redis' in a worker, ``shared.clock``) is past it."""
        if self.deadline_ms is None:
            return False
        now = clock.now_s() * 1000.0 if now_ms is None else now_ms
        return now > self.deadline_ms

    def to_kwargs(self) -> dict[str, Any]:
        """The Celery ``kwargs`` of the task message."""
        return {ENVELOPE_KWARG: self.model_dump(mode="json")}

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> TaskEnvelope:
        """Parse a task's kwargs.

        Raises:
            InvalidInput: the envelope is missing or malformed.
            UnsupportedModality: the modality is not one the fleet serves.
        """
        raw = kwargs.get(ENVELOPE_KWARG) if isinstance(kwargs, dict) else None
        if not isinstance(raw, dict):
            raise InvalidInput(f"task kwargs must hold a {ENVELOPE_KWARG!r} object")
        try:
            env = cls.model_validate(raw)
        except ValidationError as exc:
            raise InvalidInput(f"malformed request envelope: {_short(exc)}") from None
        if env.modality not in MODALITIES:
            raise UnsupportedModality(f"unknown modality {env.modality!r}")
        return env


def _short(exc: ValidationError) -> str:
    errs = exc.errors()[:3]
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errs)
