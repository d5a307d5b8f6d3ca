"""Fixtures of the transport's unit tests: a fresh /dev/shm root per test and stores on it
(helpers: ``helpers.py``)."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.transport import ShmStore
from tests.unit.transport.helpers import MIB, SHM, TEST_PREFIX


@pytest.fixture(scope="module", autouse=True)
def _nothing_left_in_shm() -> Iterator[None]:
    if not SHM.is_dir():
        yield
        return
    before = {p.name for p in SHM.iterdir() if p.name.startswith(TEST_PREFIX)}
    yield
    after = {p.name for p in SHM.iterdir() if p.name.startswith(TEST_PREFIX)}
    assert after <= before, f"left behind in /dev/shm: {sorted(after - before)}"


@pytest.fixture
def root() -> Iterator[Path]:
    path = SHM / f"{TEST_PREFIX}{uuid.uuid4().hex}"
    yield path
    if path.is_symlink():
        path.unlink()
    shutil.rmtree(path, ignore_errors=True)
    assert not path.exists() and not path.is_symlink()


@pytest.fixture
def store(root: Path) -> ShmStore:
    return ShmStore(root, capacity_bytes=1 << 30)


@pytest.fixture
def rstore(root: Path) -> ShmStore:
    """A recycling store."""
    return ShmStore(root, capacity_bytes=1 << 30, recycle_bytes=64 * MIB)


@pytest.fixture
def reader(root: Path) -> Iterator[ShmStore]:
    """A store with a reader cache."""
    r = ShmStore(root, capacity_bytes=1 << 30, reader_cache_bytes=64 * MIB)
    yield r
    r.close()
