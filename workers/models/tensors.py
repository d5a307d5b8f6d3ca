"""Tensor inputs and outputs of adapters, through the fleet's transport (``shared.transport``).

Outputs: an adapter returns a large array (a video's per-frame embeddings, many text
embeddings) as a *wire object* instead of a JSON list of floats:

- ``{"kind": "shm", ...}``: a :class:`~shared.transport.TensorRef` to a segment this worker
  wrote in ``/dev/shm`` (detached: it lives for ``transport.default_ttl_s`` seconds whatever
  happens to the worker; the client that reads the result releases it, the janitor reclaims
  it after the TTL otherwise);
- ``{"kind": "inline", ...}``: the raw bytes in base64 (see
  :mod:`shared.transport.inline`), for arrays of at most ``inline_max_bytes`` or when
  producers and workers share no ``/dev/shm`` (``transport.shared_host = false``).

So a result stored in Redis stays small whatever the array size. ``producer.client``
(``FleetClient.resolve``) turns both forms back into numpy arrays.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shared import tracing
from shared.errors import ShmCapacityError
from shared.tensor_wire import SHM
from shared.transport import ShmStore, TensorRef, encode_inline, process_store

if TYPE_CHECKING:
    from shared.settings import Settings

log = logging.getLogger(__name__)

DEFAULT_INLINE_MAX_BYTES = 16 * 1024
"""Largest output array sent inline by default: 16 KiB raw, about 22 KB of base64 (e.g. 8
embeddings of 512 float32). Larger ones go through shared memory."""


class TensorIO:
    """Reads input refs and writes output arrays for one adapter (one worker process).

    Args:
        settings: fleet settings (``[transport]`` and ``limits.max_inline_bytes``).
        inline_max_bytes: outputs up to this many raw bytes go inline.

    The shared-memory store is opened on first use, so adapters that never see a ref do not
    touch ``/dev/shm``.
    """

    def __init__(self, settings: Settings, inline_max_bytes: int = DEFAULT_INLINE_MAX_BYTES):
        self.settings = settings
        self.inline_max_bytes = int(inline_max_bytes)
        self._store: ShmStore | None = None

    @property
    def store(self) -> ShmStore:
        if self._store is None:
            self._store = process_store(self.settings, role="worker")
        return self._store

    def read(self, ref: TensorRef | Mapping[str, Any]) -> np.ndarray:
        """Map an input segment: a read-only, zero-copy numpy view.

        Raises:
            TensorRefError: malformed, unknown, expired or mismatching ref.
        """
        with tracing.span("shm.get"):
            return self.store.get(ref)

    def pack(self, array: np.ndarray) -> dict[str, Any]:
        """One output array as a wire object (shm ref or inline), see the module docstring.

        When the shared-memory budget is exhausted, an array of at most
        ``limits.max_inline_bytes`` goes inline instead: the request has been computed, and
        Redis can carry it.

        Raises:
            ShmCapacityError: the shared-memory budget is exhausted and the array is over
                ``limits.max_inline_bytes``.
            PayloadTooLarge: inline only (no shared host) and over ``limits.max_inline_bytes``.
        """
        t = self.settings.transport
        max_inline = self.settings.limits.max_inline_bytes
        if array.nbytes <= self.inline_max_bytes or not t.shared_host:
            return encode_inline(array, max_inline)
        try:
            with tracing.span("shm.put", bytes=int(array.nbytes)):
                ref = self.store.put(array, ttl_s=t.default_ttl_s, detach=True)
        except ShmCapacityError:
            if array.nbytes > max_inline:
                raise
            log.warning(
                "shared-memory budget exhausted: a %d-byte output goes inline", array.nbytes
            )
            return encode_inline(array, max_inline)
        return ref.to_dict()

    def pack_all(self, arrays: Sequence[np.ndarray]) -> list[dict[str, Any]]:
        """Pack several arrays; on a failure, release the segments already written."""
        out: list[dict[str, Any]] = []
        try:
            for a in arrays:
                out.append(self.pack(a))
        except BaseException:
            self.release_all(out)
            raise
        return out

    def release_all(self, wires: Sequence[Mapping[str, Any]]) -> None:
        """Release the shm segments among ``wires`` (best effort, idempotent)."""
        for w in wires:
            if w.get("kind") == SHM and self._store is not None:
                with contextlib.suppress(Exception):  # already gone or malformed
                    self._store.release(w["id"])
