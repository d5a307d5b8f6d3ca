"""The transport probe's contract, shared by the worker that runs it (``workers.probe``) and
the producer tooling that sends it (``producer.tools.bench.transport``): the task name and the
checksum both sides compute over a tensor's bytes."""

from __future__ import annotations

import numpy as np

__all__ = ["PROBE_TASK", "byte_checksum"]

PROBE_TASK = "fleet.transport_probe"


def byte_checksum(arr: np.ndarray) -> int:
    """The sum, modulo 2**64, of ``arr``'s raw bytes read as little-endian uint64 words (the
    last partial word zero-padded): reads every byte once, at memory bandwidth.

    Bytes as words rather than a float sum of the elements, which converts every element
    and is several times slower (see docs/decisions.md, "Probe checksum"). Equal bytes give
    equal checksums on every host; any single changed word changes it.

    Args:
        arr: any array (a C-contiguous one, e.g. a mapped segment, is not copied).
    """
    raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    whole = raw.size // 8 * 8
    total = int(np.add.reduce(raw[:whole].view("<u8"), dtype=np.uint64)) if whole else 0
    tail = raw[whole:]
    if tail.size:
        total += int.from_bytes(tail.tobytes() + bytes(8 - tail.size), "little")
    return total % 2**64
