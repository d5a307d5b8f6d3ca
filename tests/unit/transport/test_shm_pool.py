"""Tests of recycling (shared/transport/pool.py): the pool of released files and the
writer's kept mappings; a file is never rewritten under a live view, in any process.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from shared.errors import TensorRefError
from shared.transport import ShmStore
from tests.unit.transport.helpers import MIB, REPO, needs_shm, pool_files, sample, segment_files

pytestmark = needs_shm


def test_recycling_is_off_by_default(store: ShmStore) -> None:
    ref = store.put(np.ones(2 * MIB, np.uint8))
    assert store.release(ref)
    assert segment_files(store.root) == []


def test_recycled_file_is_rewritten_under_a_new_id(rstore: ShmStore) -> None:
    a, b = sample("float32", (MIB,), 1), sample("float32", (MIB,), 2)  # 4 MiB each
    ra = rstore.put(a)
    inode = (rstore.root / f"{ra.id}.arrow").stat().st_ino
    assert rstore.release(ra)
    [pooled] = pool_files(rstore.root)
    assert rstore.pool_bytes() > a.nbytes and rstore.used_bytes() == rstore.pool_bytes()
    with pytest.raises(TensorRefError, match="unknown tensor"):
        rstore.get(ra)  # a released id never resolves again
    rb = rstore.put(b)
    assert rb.id != ra.id and rb.id not in pooled
    path = rstore.root / f"{rb.id}.arrow"
    assert path.stat().st_ino == inode  # the same pages, now holding b
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert segment_files(rstore.root) == [f"{rb.id}.arrow"]
    np.testing.assert_array_equal(rstore.get(rb), b)
    # A slightly larger one reuses it too (the rest is allocated by the write) ...
    assert rstore.release(rb)
    larger = sample("float32", (MIB + 1000,), 6)
    rl = rstore.put(larger)
    assert (rstore.root / f"{rl.id}.arrow").stat().st_ino == inode
    np.testing.assert_array_equal(rstore.get(rl), larger)
    rb = rl
    # ... and a smaller tensor (at least half its size) a larger file, truncated to fit.
    assert rstore.release(rb)
    small = sample("float32", (MIB * 3 // 4,), 3)
    rs = rstore.put(small)
    assert (rstore.root / f"{rs.id}.arrow").stat().st_ino == inode
    np.testing.assert_array_equal(rstore.get(rs), small)
    assert rstore.used_bytes() < a.nbytes
    assert rstore.release(rs)
    # A tensor under half the file's size leaves it for tensors of its own size.
    tiny = sample("float32", (MIB // 4,), 4)  # 1 MiB
    rt = rstore.put(tiny)
    assert (rstore.root / f"{rt.id}.arrow").stat().st_ino != inode
    assert len(pool_files(rstore.root)) == 1
    assert rstore.release(rt)
    assert rstore.trim_pool() and segment_files(rstore.root) == []


def test_same_size_puts_write_through_the_kept_mapping(rstore: ShmStore) -> None:
    tensors = [sample("float32", (MIB,), seed) for seed in range(4)]  # 4 MiB each
    ref = rstore.put(tensors[0])
    inode = (rstore.root / f"{ref.id}.arrow").stat().st_ino
    assert rstore.kept_puts == 0 and rstore.kept_bytes() > tensors[0].nbytes
    for i, t in enumerate(tensors[1:], start=1):
        assert rstore.release(ref)
        ref = rstore.put(t)
        assert rstore.kept_puts == i  # one memcpy into the pages mapped since the first put
        assert (rstore.root / f"{ref.id}.arrow").stat().st_ino == inode
        np.testing.assert_array_equal(rstore.get(ref), t)
    # another size cannot use the mapping: it is dropped and the file rewritten by write()
    assert rstore.release(ref)
    other = sample("float32", (MIB // 2,), 9)
    r2 = rstore.put(other)
    assert rstore.kept_puts == 3
    np.testing.assert_array_equal(rstore.get(r2), other)
    assert rstore.release(r2)
    assert rstore.trim_pool() and rstore.kept_bytes() == 0  # gone files keep no mapping
    assert segment_files(rstore.root) == []


def test_gc_by_another_store_frees_the_kept_mapping(rstore: ShmStore) -> None:
    ref = rstore.put(sample("uint8", (2 * MIB,), 1))
    rstore.release(ref)
    assert rstore.kept_bytes() > 0
    janitor = ShmStore(rstore.root, capacity_bytes=1 << 30)  # e.g. `fleet shm gc`
    assert janitor.gc(now=time.time() + rstore.recycle_idle_s + 1)
    # the pool file is unlinked; the next put notices and unmaps its pages
    r2 = rstore.put(sample("uint8", (2 * MIB,), 2))
    assert rstore.kept_puts == 0 and rstore.kept_bytes() > 0  # only the new file's mapping
    rstore.release(r2)
    rstore.trim_pool()
    assert rstore.kept_bytes() == 0


@pytest.mark.parametrize("reader", ["get", "get_torch"])
def test_a_mapped_file_is_never_rewritten(rstore: ShmStore, reader: str) -> None:
    if reader == "get_torch":
        pytest.importorskip("torch")
    a, b = sample("float32", (MIB,), 4), sample("float32", (MIB,), 5)
    ra = rstore.put(a)
    view = getattr(rstore, reader)(ra)  # holds a mapping of the file
    rstore.release(ra)
    rb = rstore.put(b)  # finds the pool file still mapped: drops it, writes a fresh one
    np.testing.assert_array_equal(np.asarray(view), a)  # the reader still sees a, not b
    np.testing.assert_array_equal(rstore.get(rb), b)
    assert pool_files(rstore.root) == []  # unlinked; its pages go with the mapping
    del view
    rstore.release(rb)
    rstore.trim_pool()


def test_mapped_in_another_process_is_never_rewritten(rstore: ShmStore) -> None:
    a, b = sample("uint8", (2 * MIB,), 6), sample("uint8", (2 * MIB,), 7)
    ra = rstore.put(a, detach=True)
    code = """
        import sys, time
        import numpy as np
        from shared.transport import ShmStore, TensorRef
        store = ShmStore(sys.argv[1])
        view = store.get(TensorRef.model_validate_json(sys.argv[2]))
        print("mapped", flush=True)
        sys.stdin.readline()
        print(int(view.astype(np.int64).sum()), flush=True)
    """
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), str(rstore.root), ra.model_dump_json()],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "mapped"
        rstore.release(ra)
        rb = rstore.put(b)
        child.stdin.write("\n")
        child.stdin.flush()
        assert int(child.stdout.readline()) == int(a.astype(np.int64).sum())
    finally:
        child.kill()
        child.wait(timeout=30)
    np.testing.assert_array_equal(rstore.get(rb), b)
    rstore.release(rb)
    rstore.trim_pool()


def test_an_idle_producer_lets_go_of_files_unlinked_elsewhere(rstore: ShmStore) -> None:
    rstore.release(rstore.put(sample("uint8", (2 * MIB,), 1)))
    assert rstore.kept_bytes() > 0
    ShmStore(rstore.root).trim_pool()  # e.g. a janitor; the producer itself does nothing
    deadline = time.monotonic() + 10
    while rstore.kept_bytes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rstore.kept_bytes() == 0  # its sweeper dropped the mapping: the pages can go


def test_trim_pool_can_leave_other_producers_files(rstore: ShmStore, root: Path) -> None:
    other = ShmStore(root, capacity_bytes=1 << 30, recycle_bytes=64 * MIB)
    other.release(other.put(sample("uint8", (2 * MIB,), 1)))
    rstore.release(rstore.put(sample("uint8", (3 * MIB,), 2)))
    [mine] = rstore.trim_pool(only_own=True)
    assert pool_files(root) != [] and mine not in pool_files(root)  # the other's stays
    assert other.trim_pool(only_own=True) and pool_files(root) == []
    other.close()


def test_producers_sharing_the_pool_never_change_a_live_view(root: Path) -> None:
    """Three processes put tensors of four close shapes into one recycling pool, read each
    back through a reader cache, keep some views alive and check them after every put."""
    code = """
        import sys
        import numpy as np
        from shared.transport import ShmStore
        seed, n = int(sys.argv[2]), int(sys.argv[3])
        w = ShmStore(sys.argv[1], capacity_bytes=1 << 30, recycle_bytes=32 << 20)
        r = ShmStore(sys.argv[1], capacity_bytes=1 << 30, reader_cache_bytes=64 << 20)
        rng = np.random.default_rng(seed)
        shapes = [(1024, 256), (1024, 255), (1024, 252), (1030, 256)]
        held, bad = [], 0
        for i in range(n):
            a = np.full(shapes[rng.integers(4)], seed * 100_000 + i, np.int32)
            ref = w.put(a)
            view = r.get(ref)
            bad += not np.array_equal(view, a)
            if rng.random() < 0.3:
                held = [*held[-6:], (view, a)]
            del view
            w.release(ref)
            bad += sum(not np.array_equal(v, e) for v, e in held)
        print(bad, w.kept_puts, r.reader_cache.hits, flush=True)
    """
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    script = textwrap.dedent(code)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(root), str(seed), "80"],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        for seed in (1, 2, 3)
    ]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    bad, kept_puts, hits = (sum(int(o[k]) for o in outs) for k in range(3))
    assert bad == 0
    assert kept_puts > 0 and hits > 0  # files were rewritten and read through kept mappings
    ShmStore(root).trim_pool()
    assert segment_files(root) == []


def test_pool_budget_small_files_and_gc(root: Path) -> None:
    store = ShmStore(root, capacity_bytes=1 << 30, recycle_bytes=5 * MIB)
    refs = [store.put(np.zeros(3 * MIB, np.uint8)) for _ in range(2)]
    tiny = store.put(np.zeros(1000, np.uint8))
    for r in [*refs, tiny]:
        assert store.release(r)
    assert len(pool_files(root)) == 1  # the second 3 MiB file would pass the 5 MiB budget
    assert segment_files(root) == pool_files(root)  # small files are never pooled
    assert store.gc() == []  # not idle yet
    [name] = store.gc(now=time.time() + store.recycle_idle_s + 1)
    assert name.startswith(".pool-") and segment_files(root) == []


def test_pool_is_dropped_before_a_put_is_refused(root: Path) -> None:
    store = ShmStore(root, capacity_bytes=6 * MIB, recycle_bytes=6 * MIB)
    store.release(store.put(np.zeros(3 * MIB, np.uint8)))
    assert len(pool_files(root)) == 1
    big = store.put(np.zeros(4 * MIB, np.uint8))  # 3 pooled + 4 > 6: the pool goes first
    assert segment_files(root) == [f"{big.id}.arrow"]
    store.release(big)
    store.trim_pool()
    # Both reclaims when the pool alone is not enough: pool (3 MiB), then an expired segment.
    store.put(np.zeros(2 * MIB, np.uint8), ttl_s=0.05)
    store.release(store.put(np.zeros(3 * MIB, np.uint8)))
    assert len(pool_files(root)) == 1
    time.sleep(0.1)
    big = store.put(np.zeros(5 * MIB, np.uint8))
    assert segment_files(root) == [f"{big.id}.arrow"]
    store.release(big)
    store.trim_pool()
    with pytest.raises(ValueError):
        ShmStore(root, recycle_bytes=-1)


def mapped_inodes() -> set[int]:
    """Inodes of the files this process maps (``/proc/self/maps``; a mapping shows the name
    the file was opened by, which a published segment no longer has)."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return {int(fields[4]) for fields in map(str.split, lines) if len(fields) > 5}


def test_a_forked_child_drops_the_kept_mappings_at_the_fork(rstore: ShmStore) -> None:
    """The child shares the kept files' descriptions: it closes its copies at once (nothing of
    the parent's is unlocked or unmapped), and the parent goes on writing through them."""
    first = sample("uint8", (2 * MIB,), 1)
    rstore.release(rstore.put(first))
    assert rstore.kept_bytes() > 0
    [pooled] = pool_files(rstore.root)
    inode = (rstore.root / pooled).stat().st_ino
    assert inode in mapped_inodes()  # the parent's kept mapping
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, json.dumps([rstore.kept_bytes(), inode in mapped_inodes()]).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        kept_in_child, mapped_in_child = json.loads(f.read())
    os.waitpid(pid, 0)
    assert kept_in_child == 0 and not mapped_in_child
    second = sample("uint8", (2 * MIB,), 2)
    ref = rstore.put(second)
    assert rstore.kept_puts == 1  # through the parent's mapping, still its own
    np.testing.assert_array_equal(rstore.get(ref), second)
    rstore.release(ref)
    rstore.trim_pool()
