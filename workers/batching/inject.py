"""Injected request failures, for tests and drills (off unless
``[debug] fault_injection = true``): a request asks to fail on purpose.

A request asks with an extra input key ``"_inject"``; the engine strips it before the
adapter sees the inputs. With injection off the key is passed through and the adapter
refuses it like any unknown key, so production traffic cannot trigger these paths. (The
chaos and HA drills' faults, done to processes and Redis from outside, are
``producer.tools.chaos.faults``.)

Failures a request may ask for (checked right before a batch containing it runs, or while
its input is decoded):

- ``"transient:N"``  raise :class:`TransientError` on the request's first N attempts.
- ``"model_error"``  the batch raises ``RuntimeError`` (the engine bisects to isolate it).
- ``"oom"``          the batch raises an out-of-memory error while it holds more than one
                     request (a batch too big for the partition: split and recovered).
- ``"oom_always"``   out-of-memory even alone (fails alone with ``DEVICE_OOM``).
- ``"crash"``        the worker process exits at once (a poison message).
- ``"slow:S"``       the batch takes S more seconds (a long video, a hung model call).
- ``"crash_prepare"`` the worker process exits while decoding the request's input (a media
                     header that crashes a decoder).
- ``"slow_prepare:S"`` decoding the request's input takes S more seconds (a large image on a
                     busy host: what else happens meanwhile must not be blamed on it).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Sequence

from shared.errors import TransientError

INJECT_KEY = "_inject"


class InjectedOOM(RuntimeError):
    """Stands in for ``torch.OutOfMemoryError`` (same message shape) on CPU."""

    def __init__(self) -> None:
        super().__init__("CUDA out of memory (injected fault)")


class RequestInjector:
    """Reads and acts on the ``"_inject"`` spec of requests, when ``enabled``."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.attempts: Counter[str] = Counter()

    def split(self, inputs: dict[str, object]) -> tuple[dict[str, object], str | None]:
        """Remove and return the injection spec when injection is on; else leave inputs as
        is."""
        if not self.enabled or not isinstance(inputs, dict) or INJECT_KEY not in inputs:
            return inputs, None
        rest = {k: v for k, v in inputs.items() if k != INJECT_KEY}
        spec = inputs[INJECT_KEY]
        return rest, spec if isinstance(spec, str) else None

    def on_prepare(self, spec: str | None) -> None:
        """Act on a failure due while the request's input is decoded."""
        if spec == "crash_prepare":
            os._exit(70)
        if spec and spec.startswith("slow_prepare:"):
            time.sleep(float(spec.split(":", 1)[1]))

    def before_batch(self, batch: Sequence[tuple[str, str | None]]) -> None:
        """Raise the injected failure of a batch of ``(request_id, spec)``, if any."""
        for request_id, spec in batch:
            if not spec:
                continue
            if spec == "crash":
                os._exit(70)
            if spec.startswith("slow:"):
                time.sleep(float(spec.split(":", 1)[1]))
            if spec == "model_error":
                raise RuntimeError("injected model fault")
            if spec == "oom_always" or (spec == "oom" and len(batch) > 1):
                raise InjectedOOM()
            if spec.startswith("transient:"):
                self.attempts[request_id] += 1
                if self.attempts[request_id] <= int(spec.split(":", 1)[1]):
                    raise TransientError(f"injected transient fault #{self.attempts[request_id]}")
