"""Tests of the inventory (shared/transport/inventory.py): ls and gc of expired, orphaned
(owner killed), stale temp and corrupt files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from shared.errors import TensorRefError
from shared.transport import ShmStore
from shared.transport.ref import hostname, new_id
from tests.unit.transport.helpers import REPO, needs_shm, ref_for, segment_files

pytestmark = needs_shm


def test_ttl_expiry_and_gc(store: ShmStore) -> None:
    short = store.put(np.ones(3), ttl_s=10)
    long = store.put(np.ones(3), ttl_s=1000)
    assert store.gc() == []
    assert store.gc(now=time.time() + 100) == [short.id]
    assert [s.id for s in store.ls()] == [long.id]
    assert store.gc(now=time.time() + 10_000) == [long.id]
    assert segment_files(store.root) == []


DYING_CHILD = """
    import json, sys, time
    import numpy as np
    from shared.transport import ShmStore
    store = ShmStore(sys.argv[1], capacity_bytes=1 << 30)
    owned = store.put(np.ones(1000))
    detached = store.put(np.ones(1000), detach=True)
    print(json.dumps({"owned": owned.id, "detached": detached.id}), flush=True)
    time.sleep(600)
"""


def test_dead_owner_gc(store: ShmStore) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(DYING_CHILD), str(store.root)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    try:
        assert child.stdout is not None
        ids = json.loads(child.stdout.readline())
        info = {s.id: s for s in store.ls()}
        assert info[ids["owned"]].alive_owner and info[ids["owned"]].pid == child.pid
        assert info[ids["detached"]].pid == 0
        assert store.gc() == []  # owner alive: nothing to reclaim
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)  # reaped: the pid no longer exists
        child.stdout.close()  # type: ignore[union-attr]
    info = {s.id: s for s in store.ls()}
    assert not info[ids["owned"]].alive_owner
    assert info[ids["detached"]].alive_owner
    # A temp file the dead writer left mid-write, and one of a live writer (us).
    host = hostname()
    dead_tmp = f".tmp-{new_id()}-{child.pid}-{host}.arrow"
    live_tmp = f".tmp-{new_id()}-{os.getpid()}-{host}.arrow"
    for name in (dead_tmp, live_tmp):
        (store.root / name).write_bytes(b"partial")
    removed = store.gc()
    assert sorted(removed) == sorted([ids["owned"], dead_tmp])
    assert sorted(segment_files(store.root)) == sorted([live_tmp, f"{ids['detached']}.arrow"])
    # A live writer's temp file goes only once it has stalled past default_ttl_s.
    assert live_tmp in store.gc(now=time.time() + store.default_ttl_s + 1)


def test_corrupt_segment_handled(store: ShmStore) -> None:
    seg_id = new_id()
    path = store.root / f"{seg_id}.arrow"
    path.write_bytes(b"not arrow at all")
    with pytest.raises(TensorRefError, match="not a valid Arrow IPC file"):
        store.get(ref_for(seg_id, (2,), "float32"))
    assert store.ls() == []
    assert store.gc() == []  # young: might be someone's in an unexpected state; keep
    assert store.gc(now=time.time() + store.default_ttl_s + 1) == [seg_id]
