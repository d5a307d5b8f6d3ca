"""Tests of the fleet directory (shared/transport/root.py): modes, refusals, the capacity
budget across processes, and the root lock across a fork.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from shared.errors import ShmCapacityError, TensorRefError, TransportError
from shared.transport import ShmStore
from shared.transport import root as root_mod
from tests.unit.transport.helpers import REPO, needs_shm, segment_files

pytestmark = needs_shm


def test_modes(store: ShmStore) -> None:
    ref = store.put(np.ones(10))
    assert stat.S_IMODE(os.lstat(store.root).st_mode) == 0o700
    seg = store.root / f"{ref.id}.arrow"
    assert stat.S_IMODE(os.lstat(seg).st_mode) == 0o600
    assert segment_files(store.root) == [seg.name]  # no temp file left


def test_modes_despite_umask(root: Path) -> None:
    old = os.umask(0o277)  # would strip the owner's write and exec bits
    try:
        store = ShmStore(root, capacity_bytes=1 << 20)
        ref = store.put(np.ones(3))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(root / f"{ref.id}.arrow").st_mode) == 0o600


def test_root_refusals(root: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    root.symlink_to(target)
    with pytest.raises(TransportError, match="symlink"):
        ShmStore(root)
    root.unlink()
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    with pytest.raises(TransportError, match="mode 0755"):
        ShmStore(root)
    os.chmod(root, 0o700)
    ShmStore(root)  # now fine
    with pytest.raises(TransportError, match="does not exist"):
        ShmStore(root / "missing" / "deeper")


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
def test_foreign_owner_refused(root: Path, store: ShmStore) -> None:
    ref = store.put(np.ones(4))
    seg = root / f"{ref.id}.arrow"
    os.chown(seg, 65534, 65534)
    with pytest.raises(TensorRefError, match="regular file of this user"):
        store.get(ref)
    os.chown(root, 65534, 65534)
    with pytest.raises(TransportError, match="owned by uid 65534"):
        ShmStore(root)


def test_symlinked_segment_refused(store: ShmStore, tmp_path: Path) -> None:
    # A valid segment outside the root, linked in under a valid id: must not be followed.
    outside = ShmStore(store.root.with_name(store.root.name + "-outside"), capacity_bytes=1 << 20)
    try:
        ref = outside.put(np.arange(5))
        (store.root / f"{ref.id}.arrow").symlink_to(outside.root / f"{ref.id}.arrow")
        with pytest.raises(TensorRefError, match="not a regular file"):
            store.get(ref)
        with pytest.raises(TensorRefError, match="not a regular file"):
            store.release(ref)
        assert (outside.root / f"{ref.id}.arrow").exists()
        assert ref.id not in [s.id for s in store.ls()]
    finally:
        shutil.rmtree(outside.root)


def test_capacity_refusal_leaves_nothing(root: Path) -> None:
    store = ShmStore(root, capacity_bytes=1 << 20)  # 1 MiB
    with pytest.raises(ShmCapacityError, match="budget exceeded"):
        store.put(np.zeros(2 << 20, np.uint8))
    assert segment_files(root) == []
    first = store.put(np.zeros(600 << 10, np.uint8))
    with pytest.raises(ShmCapacityError):
        store.put(np.zeros(600 << 10, np.uint8))
    assert segment_files(root) == [f"{first.id}.arrow"]
    assert store.used_bytes() <= store.capacity_bytes
    store.release(first)
    store.put(np.zeros(600 << 10, np.uint8))  # fits again


def test_capacity_reclaims_expired_before_refusing(root: Path) -> None:
    store = ShmStore(root, capacity_bytes=1 << 20)
    old = store.put(np.zeros(600 << 10, np.uint8), ttl_s=0.05)
    time.sleep(0.1)
    new = store.put(np.zeros(600 << 10, np.uint8))  # gc of the expired one makes room
    assert segment_files(root) == [f"{new.id}.arrow"]
    assert old.id != new.id


def test_filesystem_free_space_checked(store: ShmStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(root_mod, "fs_free_bytes", lambda root: 1000)
    with pytest.raises(ShmCapacityError, match="free"):
        store.put(np.zeros(1 << 16))
    assert segment_files(store.root) == []


def test_default_capacity_and_check(root: Path) -> None:
    store = ShmStore(root)
    assert store.capacity_bytes == int(store.fs_total_bytes() * 0.5)
    big = ShmStore(root, capacity_bytes=store.fs_total_bytes() * 2)
    msg = big.check_capacity()
    assert msg and "less than the transport budget" in msg and "lower the budget" in msg
    small = ShmStore(root, capacity_bytes=64 << 20)
    msg = small.check_capacity()
    assert msg and "only 64.0 MiB" in msg
    assert "raise the budget" in msg and "lower" not in msg  # /dev/shm here holds far more
    ok = ShmStore(root, capacity_bytes=min(1 << 30, store.fs_free_bytes() // 2))
    assert ok.check_capacity(min_bytes=0) is None


PUT_CHILD = """
    import json, sys
    import numpy as np
    from shared.errors import ShmCapacityError
    from shared.transport import ShmStore
    store = ShmStore(sys.argv[1], capacity_bytes=int(sys.argv[2]))
    try:
        # detach: these writers exit at once; a dead owner's segment would be reclaimed.
        ref = store.put(np.zeros(int(sys.argv[3]), np.uint8), detach=True)
        print(json.dumps({"ok": ref.id}))
    except ShmCapacityError:
        print(json.dumps({"ok": None}))
"""


def test_capacity_is_exact_across_concurrent_processes(root: Path) -> None:
    ShmStore(root, capacity_bytes=1 << 20)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [str(root), str(1 << 20), str(400 << 10)]  # room for two 400 KiB segments, not 3
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(PUT_CHILD), *args],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        for _ in range(5)
    ]
    results = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert sum(r["ok"] is not None for r in results) == 2
    assert len(segment_files(root)) == 2


def test_a_child_forked_during_a_put_elsewhere_can_put(rstore: ShmStore) -> None:
    """A child forked while another thread holds the root lock must not keep it."""
    stop = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            rstore.release(rstore.put(np.full((256, 256 + i % 7), i, np.int32)))
            i += 1

    t = threading.Thread(target=churn)
    t.start()
    hung = 0
    try:
        for _ in range(60):
            time.sleep(0.002)  # let the other thread into put()
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)  # (pytest-timeout's handler)
                signal.alarm(5)  # a hang ends the child with SIGALRM
                try:
                    ShmStore(rstore.root).release(ShmStore(rstore.root).put(np.ones(10)))
                finally:
                    os._exit(0)
            _, status = os.waitpid(pid, 0)
            hung += os.WIFSIGNALED(status)
    finally:
        stop.set()
        t.join()
    assert hung == 0
    rstore.trim_pool()
