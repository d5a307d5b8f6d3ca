"""Tests of the read path (shared/transport/reader.py): refused reads keep no mapping, and
running out of descriptors is a TransportError.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from shared.errors import TensorRefError
from shared.transport import ShmStore
from tests.unit.transport.helpers import MIB, REPO, needs_shm, sample

pytestmark = needs_shm


def test_a_refused_read_leaves_no_mapping_behind(store: ShmStore) -> None:
    """A caller may keep the exception (Celery keeps it in a reference cycle): it must not
    keep the mapping, its pages and its lock with it."""
    ref = store.put(sample("float32", (MIB,), 1))
    kept = []
    for bad in ({**ref.to_dict(), "shape": [MIB // 2, 2]}, {**ref.to_dict(), "dtype": "int32"}):
        try:
            store.get(bad)
        except TensorRefError as exc:
            kept.append(exc)
    assert len(kept) == 2
    maps = Path("/proc/self/maps").read_text().splitlines()
    assert [ln for ln in maps if ref.id in ln] == []
    store.release(ref)


def test_running_out_of_descriptors_is_a_transport_error(rstore: ShmStore) -> None:
    code = """
        import resource, sys
        import numpy as np
        from shared.errors import FleetError
        from shared.transport import ShmStore
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        w = ShmStore(sys.argv[1], capacity_bytes=1 << 30)
        r = ShmStore(sys.argv[1], capacity_bytes=1 << 30)
        views = []
        try:
            for i in range(200):
                views.append(r.get(w.put(np.zeros(1000, np.uint8), detach=True)))
        except FleetError as exc:
            print(exc.code, flush=True)
    """
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(rstore.root)],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=60,
    )  # fmt: skip
    assert out.stdout.strip() == "TRANSPORT_ERROR", out.stderr[-2000:]
    ShmStore(rstore.root).gc(now=time.time() + 10_000)
