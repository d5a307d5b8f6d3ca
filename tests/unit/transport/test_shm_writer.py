"""Tests of put's write path (shared/transport/writer.py): ENOSPC, budgets when a pool
file is claimed, and rewriting a file another store sized differently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pytest

from shared.errors import ShmCapacityError
from shared.transport import ShmStore
from shared.transport import segment as segment_mod
from tests.unit.transport.helpers import KIB, MIB, needs_shm, segment_files

pytestmark = needs_shm


def test_enospc_during_write_is_capacity_error(
    store: ShmStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(sink: Any, schema: pa.Schema, batch: pa.RecordBatch) -> None:
        sink.write(b"\0" * 4096)  # something partial reaches the file first
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(segment_mod, "write_ipc", full_disk)
    with pytest.raises(ShmCapacityError, match="no space left"):
        store.put(np.zeros(1 << 16))
    assert segment_files(store.root) == []


def test_growing_a_claimed_file_respects_the_budget(root: Path) -> None:
    store = ShmStore(root, capacity_bytes=2 * MIB + 20 * KIB, recycle_bytes=4 * MIB)
    store.release(store.put(np.zeros(2 * MIB, np.uint8)))
    with pytest.raises(ShmCapacityError, match="budget exceeded"):
        store.put(np.zeros(2 * MIB + 40 * KIB, np.uint8))  # 40 KiB more than the pool file
    assert segment_files(root) == []  # the claimed file is gone with the refused put


def test_a_small_budget_is_kept_when_claiming_another_stores_file(root: Path) -> None:
    big = ShmStore(root, capacity_bytes=1 << 30, recycle_bytes=64 * MIB)
    big.release(big.put(np.zeros(4 * MIB, np.uint8)))  # a 4 MiB pool file
    tiny = ShmStore(root, capacity_bytes=100_000, recycle_bytes=64 * MIB)
    with pytest.raises(ShmCapacityError, match="budget exceeded"):
        tiny.put(np.zeros(4 * MIB, np.uint8))
    assert segment_files(root) == []  # the claimed file went with the refusal
    big.close()


def test_two_recycling_stores_sharing_the_pool_at_other_sizes(root: Path) -> None:
    """A's kept descriptor ends where A's first write ended; B rewrites the file at another
    size; A's next claim must write from byte 0 again, not append."""
    a = ShmStore(root, capacity_bytes=1 << 30, recycle_bytes=64 * MIB)
    b = ShmStore(root, capacity_bytes=1 << 30, recycle_bytes=64 * MIB)
    a.release(a.put(np.full((1024, 1024), 1, np.float32)))
    b.release(b.put(np.full((1024, 1020), 2, np.float32)))  # the same file, 16 KiB smaller
    third = np.full((1024, 1024), 3, np.float32)
    ref = a.put(third)
    assert a.kept_puts == 0  # the kept mapping no longer fits the file: written by write()
    np.testing.assert_array_equal(a.get(ref), third)
    assert (root / f"{ref.id}.arrow").stat().st_size < third.nbytes + 64 * KIB
    a.release(ref)
    a.trim_pool()
    a.close()
    b.close()
