"""A request's fingerprint: what makes two POSTs with one id the same request.

The request ``id`` (or ``Idempotency-Key``) names the job, so a repeated POST with that id
answers the job it made (an idempotent retry). Clients also reuse ids for different requests
(Triton clients often send a fixed or counting ``id``): without a check the second request
would silently get the first one's result. The job record therefore keeps a fingerprint of
its request and a POST whose fingerprint differs is refused ``ID_CONFLICT`` (409).

The fingerprint covers what decides the result: the model and the request's decoded fleet
inputs (the text, texts, the image file, ``parameters.top_k``), and a video's raw file bytes
(not its /dev/shm refs, which each attempt writes anew). It is taken over the decoded inputs,
not the body's bytes: a retry that re-encodes the same content (JSON whitespace, key order,
base64 in JSON or binary data) is the same request. Scheduling and rendering are not part of
it: ``parameters.priority``, ``parameters.timeout``, the outputs asked for (binary or JSON),
``Prefer``: a retry may change them and still gets the job it made, as it was first sent.

SHA-256 over the canonical JSON of ``{"model", "inputs"}`` (sorted keys, no whitespace),
then the video's bytes; its first 32 hex digits (128 bits) are kept.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["FINGERPRINT_HEX", "request_fingerprint"]

FINGERPRINT_HEX = 32  # hex digits kept: 128 bits, far past any chance collision


def request_fingerprint(model: str, inputs: dict[str, Any], video: bytes | None = None) -> str:
    """The fingerprint of a request to ``model`` with decoded fleet ``inputs`` (the options
    only, for a video) and a video's raw file bytes."""
    h = hashlib.sha256()
    canonical = json.dumps(
        {"model": model, "inputs": inputs}, sort_keys=True, separators=(",", ":")
    )
    h.update(canonical.encode("utf-8"))
    if video is not None:
        h.update(b"\x00video\x00")
        h.update(video)
    return h.hexdigest()[:FINGERPRINT_HEX]
