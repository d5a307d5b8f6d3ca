"""The model code both peers run: the worker's own adapter, called on a list of envelopes.

A peer (celery-batches, Ray Serve) brings its own queueing and batching; what it runs per
batch is the same as the fleet's: :meth:`ModelAdapter.prepare` and ``preprocess`` for each
request, then one ``run_batch`` under the device runtime's ``batch_context``, after the same
warmup the fleet's engine does (every bucket at size 1 and at ``max_batch_size``, twice).
Requests are taken in the order the peer hands them over (peers do not sort by length).

Runs inside a peer's process (the peer venv, ``make peers``), never in the bench's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from producer.tools.bench.limit import LoadedAdapter
from shared.errors import DeadlineExceeded, FleetError, ModelError
from shared.schema import TaskEnvelope


@dataclass
class Outcome:
    """One request's outcome: ``result`` (the adapter's JSON-able dict) or ``error``."""

    result: dict[str, Any] | None = None
    error: FleetError | None = None

    def to_json(self) -> dict[str, Any]:
        """``{"result": ...}`` or ``{"error": {"code", "message", "type"}}`` (the client's form)."""
        if self.error is not None:
            return {"error": self.error.to_dict()}
        return {"result": self.result}


class BatchModel(LoadedAdapter):
    """One modality's adapter and device runtime, loaded (as the bench's limit loads it)
    and warmed in this process.

    Args:
        modality: ``text``, ``image``, ...
        settings: fleet settings (default: from the environment, ``FLEET_*``, as the
            bench's stack sets them for its processes).
    """

    def __init__(self, modality: str, settings: Any = None) -> None:
        super().__init__(modality, settings)
        self.warmup_s = self.runtime.warmup(self._warmup)

    def _warmup(self) -> None:
        buckets = self.adapter.buckets() or [None]
        for bucket in buckets:
            for n in sorted({1, self.cfg.batching.max_batch_size}):
                inputs = self.adapter.example_inputs(n, bucket)
                samples = [self.adapter.preprocess(self.adapter.prepare(i)) for i in inputs]
                for _ in range(2):
                    with self.runtime.batch_context():
                        self.adapter.discard(self.adapter.run_batch(samples))

    def run(self, envelopes: list[dict[str, Any]]) -> list[Outcome]:
        """Run one batch: one :class:`Outcome` per envelope, in order.

        Args:
            envelopes: task kwargs' ``request`` dicts (:class:`~shared.schema.TaskEnvelope`).

        A bad or expired request gets its coded error and leaves the batch; a model fault
        fails the whole batch with ``MODEL_ERROR`` (peers have no bisection).
        """
        out = [Outcome() for _ in envelopes]
        samples: list[Any] = []
        members: list[int] = []
        for i, raw in enumerate(envelopes):
            try:
                env = TaskEnvelope.from_kwargs({"request": raw})
                if env.expired():
                    raise DeadlineExceeded("deadline passed before it could run")
                samples.append(self.adapter.preprocess(self.adapter.prepare(env.inputs)))
                members.append(i)
            except FleetError as exc:
                out[i].error = exc
        if not samples:
            return out
        try:
            with self.runtime.batch_context():
                results = self.adapter.run_batch(samples)
        except Exception as exc:  # the peer's whole batch fails, as it would for its users
            for i in members:
                out[i].error = ModelError(f"model failed: {exc}")
            return out
        for i, res in zip(members, results, strict=True):
            out[i].result = res
        return out
