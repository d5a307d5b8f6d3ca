"""``workers.janitor.ShmJanitor``: what every worker reclaims on its own."""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shared.settings import load_settings
from shared.transport import ShmStore
from workers.janitor import ShmJanitor


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path("/dev/shm") / f"mmfleet-test-janitor-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_janitor_reclaims_expired_segments_on_its_own(root: Path) -> None:
    settings = load_settings(transport={"shm_root": root})
    store = ShmStore(root)
    expired = store.put(np.ones(1000, np.float32), ttl_s=0.05, detach=True)
    live = store.put(np.ones(1000, np.float32), detach=True)
    time.sleep(0.1)
    janitor = ShmJanitor(settings, interval_s=0.05)
    janitor.start()
    try:
        deadline = time.monotonic() + 10
        while (root / f"{expired.id}.arrow").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        janitor.stop()
    assert not (root / f"{expired.id}.arrow").exists() and janitor.removed == 1
    np.testing.assert_array_equal(store.get(live), np.ones(1000, np.float32))
    store.release(live)
    with pytest.raises(ValueError):
        ShmJanitor(settings, interval_s=0)
