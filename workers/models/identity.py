"""``kind = "identity"``: the model that costs nothing, a benchmark instrument.

As Triton's ``identity`` backend is to perf_analyzer, this is to ``fleet bench
overhead-saturate``: every request goes through the whole fleet (publish, priority queue,
prefetch window, batcher, inference thread, result write, ack, events) while the model's own
work is a checksum, so what a bench measures is the fleet's cost per request, the figure a GPU
ten to a hundred times faster than this CPU would leave exposed.

It serves any modality whose inputs are JSON: the bytes it counts are ``inputs["text"]``
(UTF-8) when that is a string, else the inputs' canonical JSON (sorted keys, no spaces). The
result is small and fixed in size::

    {"model": "identity", "bytes": 52, "crc32": 2897446171}

``crc32`` is :func:`zlib.crc32` of those bytes, so a test or a client checks it exactly.
Requests are batched like any model's (one bucket, ``default``).
"""

from __future__ import annotations

import json
import zlib
from typing import Any, ClassVar

from shared.errors import InvalidInput
from shared.model_kinds import IdentityOptions
from workers.models.base import ModelAdapter, Prepared

MODEL_NAME = "identity"


def identity_bytes(inputs: dict[str, Any]) -> bytes:
    """The bytes the identity model counts for ``inputs`` (module doc)."""
    text = inputs.get("text")
    if isinstance(text, str):
        return text.encode("utf-8")
    return json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode("utf-8")


def identity_result(data: bytes) -> dict[str, Any]:
    """The identity model's result for ``data``."""
    return {"model": MODEL_NAME, "bytes": len(data), "crc32": zlib.crc32(data)}


class IdentityAdapter(ModelAdapter):
    """The identity model (module doc). ``load`` has nothing to load."""

    options_type: ClassVar[type[IdentityOptions]] = IdentityOptions
    tensor_inputs = False  # JSON inputs only: a /dev/shm ref is counted as its JSON

    def load(self) -> None:
        """Nothing to load: no weights, no device memory."""

    def prepare(self, inputs: dict[str, Any]) -> Prepared:
        """The bytes to count, in the one bucket.

        Raises:
            InvalidInput: ``inputs`` is not a JSON object.
        """
        if not isinstance(inputs, dict):
            raise InvalidInput("identity: inputs must be a JSON object")
        data = identity_bytes(inputs)
        return Prepared(bucket="default", length=1, nbytes=len(data), payload=data)

    def run_batch(self, samples: list[Any]) -> list[dict[str, Any]]:
        """One small dict per sample: its size and CRC-32."""
        return [identity_result(s) for s in samples]

    def example_inputs(self, batch_size: int, bucket: str | None = None) -> list[dict[str, Any]]:
        """Short texts (warmup has nothing to warm but the fleet's own path)."""
        return [{"text": f"warmup {i}"} for i in range(batch_size)]

    def torch_modules(self) -> list[Any]:
        """None: the identity model runs no torch module."""
        return []

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "name": MODEL_NAME, "weights": "none (benchmark instrument)"}
