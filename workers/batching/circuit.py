"""A per-model circuit breaker: stop feeding a model that keeps failing.

States (pure logic; every call takes ``now`` in monotonic seconds):

- CLOSED: batches run. ``threshold`` consecutive failed batches (every request of the batch
  failed with a model or device fault, or the batch timed out) open it.
- OPEN: requests fail fast with ``CIRCUIT_OPEN`` for ``cooldown_s``.
- HALF_OPEN: after the cool-down one probe batch runs; success closes the breaker, failure
  opens it again for another cool-down.

Bad input never counts: an input error is the caller's fault, not the model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class State(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    """Args: ``threshold`` consecutive failed batches to open; ``cooldown_s`` seconds open."""

    threshold: int = 5
    cooldown_s: float = 10.0
    state: State = State.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    opened_count: int = 0

    def allow(self, now: float) -> bool:
        """May a batch run now? Moves OPEN to HALF_OPEN once the cool-down has passed."""
        if self.state is State.OPEN and now - self.opened_at >= self.cooldown_s:
            self.state = State.HALF_OPEN
        return self.state is not State.OPEN

    def record_success(self) -> None:
        self.state = State.CLOSED
        self.failures = 0

    def record_failure(self, now: float) -> None:
        self.failures += 1
        if self.state is State.HALF_OPEN or self.failures >= self.threshold:
            self.state = State.OPEN
            self.opened_at = now
            self.opened_count += 1

    def snapshot(self) -> dict[str, object]:
        return {
            "state": str(self.state),
            "consecutive_failures": self.failures,
            "times_opened": self.opened_count,
        }
