"""``workers.models.tensors.TensorIO``: how an adapter's output arrays travel back."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shared.errors import ShmCapacityError
from shared.settings import load_settings
from shared.transport import ShmStore, decode_inline
from workers.models.tensors import TensorIO


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path("/dev/shm") / f"mmfleet-test-tio-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def io_for(root: Path, capacity_bytes: int) -> TensorIO:
    settings = load_settings(
        transport={"shm_root": root, "capacity_bytes": capacity_bytes},
        limits={"max_inline_bytes": 1 << 20},
    )
    return TensorIO(settings)


def test_large_outputs_go_through_shm(root: Path) -> None:
    arr = np.arange(64 * 1024, dtype=np.float32)  # 256 KiB: over the 16 KiB inline size
    wire = io_for(root, 1 << 30).pack(arr)
    assert wire["kind"] == "shm"
    np.testing.assert_array_equal(ShmStore(root).get(wire), arr)
    ShmStore(root).release(wire["id"])


def test_a_full_budget_sends_what_redis_can_carry_inline(root: Path) -> None:
    tio = io_for(root, 1000)  # no 256 KiB segment fits
    arr = np.arange(64 * 1024, dtype=np.float32)
    wire = tio.pack(arr)
    assert wire["kind"] == "inline"  # computed already: sent inline rather than lost
    np.testing.assert_array_equal(decode_inline(wire, max_bytes=1 << 20), arr)
    with pytest.raises(ShmCapacityError):
        tio.pack(np.zeros(2 << 20, np.uint8))  # over max_inline_bytes: still refused
    assert list(root.iterdir()) == []
