"""Tests of the reader cache (shared/transport/mapcache.py): one mapping serves the files a
recycling producer rewrites, views pin it, forks never unlock the other side's view.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from shared.errors import TransportError
from shared.transport import ShmStore
from tests.unit.transport.helpers import MIB, REPO, data_address, fork_keeping, needs_shm, sample

pytestmark = needs_shm


def test_reader_cache_reads_rewritten_files_through_one_mapping(
    rstore: ShmStore, reader: ShmStore
) -> None:
    tensors = [sample("float32", (MIB,), seed) for seed in range(4)]  # 4 MiB each
    addresses = set()
    ref = None
    for i, t in enumerate(tensors):
        if ref is not None:
            rstore.release(ref)
        ref = rstore.put(t)
        view = reader.get(ref)
        np.testing.assert_array_equal(view, t)  # each tensor's own bytes, never a stale one
        assert not view.flags.writeable
        addresses.add(data_address(view))
        del view  # the pin goes with the last view: the producer may rewrite the file
        assert rstore.kept_puts == i
    cache = reader.reader_cache
    assert cache is not None
    # One mapping served all four: the same virtual address, its page tables already built.
    assert len(addresses) == 1 and len(cache) == 1
    assert cache.adopted == 1 and cache.hits == 3
    rstore.release(ref)
    rstore.trim_pool()
    assert cache.sweep() == 1 and cache.mapped_bytes() == 0  # unlinked: its pages may go


def test_a_cached_view_pins_its_file(rstore: ShmStore, reader: ShmStore) -> None:
    a, b, c = (sample("float32", (MIB,), seed) for seed in (1, 2, 3))
    ra = rstore.put(a)
    view = reader.get(ra)
    derived = view[10:20]  # any view derived from it holds the pin as well
    inode = (rstore.root / f"{ra.id}.arrow").stat().st_ino
    rstore.release(ra)
    rb = rstore.put(b)  # the file is pinned: a fresh one, the pooled one unlinked
    assert (rstore.root / f"{rb.id}.arrow").stat().st_ino != inode
    assert rstore.kept_puts == 0
    np.testing.assert_array_equal(view, a)
    del view
    np.testing.assert_array_equal(derived, a[10:20])  # still pinned by the slice
    del derived
    # the last view dropped the mapping: its file was unlinked, the pages may go now
    assert reader.reader_cache is not None and len(reader.reader_cache) == 0
    # b's file, unpinned after its read, is rewritten in place for c
    np.testing.assert_array_equal(reader.get(rb), b)
    rstore.release(rb)
    rc = rstore.put(c)
    assert rstore.kept_puts == 1
    np.testing.assert_array_equal(reader.get(rc), c)
    assert reader.reader_cache.hits == 1
    rstore.release(rc)
    rstore.trim_pool()


def test_reader_cache_keeps_only_files_that_will_be_rewritten(
    store: ShmStore, reader: ShmStore
) -> None:
    ref = store.put(sample("float32", (MIB,), 1))  # a store that does not recycle
    np.testing.assert_array_equal(reader.get(ref), sample("float32", (MIB,), 1))
    assert reader.reader_cache is not None and len(reader.reader_cache) == 0
    store.release(ref)


def test_reader_cache_is_bounded_and_sweeps_unlinked_files(rstore: ShmStore, root: Path) -> None:
    reader = ShmStore(root, capacity_bytes=1 << 30, reader_cache_bytes=5 * MIB)
    cache = reader.reader_cache
    assert cache is not None
    refs = [rstore.put(sample("uint8", (2 * MIB,), seed)) for seed in range(3)]
    views = [reader.get(r) for r in refs]
    assert len(cache) == 2  # the third does not fit while the first two are pinned
    del views
    assert len(cache) == 2 and cache.mapped_bytes() <= 5 * MIB
    for r in refs:
        rstore.release(r)
    rstore.trim_pool()
    deadline = time.monotonic() + 10 * cache.sweep_interval_s
    while len(cache) and time.monotonic() < deadline:
        time.sleep(0.05)  # the sweeper thread drops mappings of unlinked files
    assert len(cache) == 0
    reader.close()


def test_a_forked_child_never_unlocks_the_parents_view(rstore: ShmStore, reader: ShmStore) -> None:
    """The child shares the parent's open file descriptions, and so their flocks: its copy
    of a view going away must not free the file for rewriting under the parent's view."""
    a, b = sample("float32", (MIB,), 1), sample("float32", (MIB,), 2)
    ra = rstore.put(a)
    view = reader.get(ra)
    pid = os.fork()
    if pid == 0:  # the child drops its copy of the view and leaves
        code = 0
        try:
            del view
            import gc

            gc.collect()
        except BaseException:
            code = 1
        os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    inode = (rstore.root / f"{ra.id}.arrow").stat().st_ino
    rstore.release(ra)
    rb = rstore.put(b)
    assert (rstore.root / f"{rb.id}.arrow").stat().st_ino != inode  # still pinned: not reused
    np.testing.assert_array_equal(view, a)
    del view
    rstore.release(rb)
    rstore.trim_pool()


def test_a_forked_childs_view_survives_the_parent_dropping_its_own(
    rstore: ShmStore, reader: ShmStore
) -> None:
    """The other direction: the parent's last unpin must not unlock the child's view."""
    a, b = sample("float32", (MIB,), 1), sample("float32", (MIB,), 2)
    ra = rstore.put(a)
    view = reader.get(ra)
    inode = (rstore.root / f"{ra.id}.arrow").stat().st_ino
    child_still_sees = fork_keeping(view, a)
    del view
    import gc

    gc.collect()
    rstore.release(ra)
    rb = rstore.put(b)  # the child's view still pins the file: a fresh one
    assert (rstore.root / f"{rb.id}.arrow").stat().st_ino != inode
    assert child_still_sees()
    rstore.release(rb)
    rstore.trim_pool()


def test_a_forked_childs_view_is_safe_without_free_descriptors(
    rstore: ShmStore, reader: ShmStore
) -> None:
    import resource

    a, b = sample("float32", (MIB,), 1), sample("float32", (MIB,), 2)
    ra = rstore.put(a)
    view = reader.get(ra)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []

    def use_up_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        with contextlib.suppress(OSError):
            while True:  # no descriptor left at the fork
                held.append(os.open(os.devnull, os.O_RDONLY))

    try:
        child_still_sees = fork_keeping(view, a, before_fork=use_up_descriptors)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    del view
    rstore.release(ra)
    rb = rstore.put(b)  # the child's copy of the view still holds the lock
    assert child_still_sees()
    rstore.release(rb)
    rstore.trim_pool()


def test_out_of_descriptors_the_cache_gives_its_idle_ones_back(
    rstore: ShmStore, reader: ShmStore
) -> None:
    import resource

    refs = [rstore.put(sample("uint8", (2 * MIB,), seed)) for seed in range(8)]
    for r in refs:
        reader.get(r)  # each view dropped at once: 8 idle cached mappings (16 descriptors)
    assert reader.reader_cache is not None and len(reader.reader_cache) == 8
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    try:
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        view = reader.get(refs[0])  # opening the file needs a descriptor: there is none ...
    except TransportError:
        view = None
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert view is not None  # ... until the idle mappings gave theirs back
    np.testing.assert_array_equal(view, sample("uint8", (2 * MIB,), 0))
    del view
    for r in refs:
        rstore.release(r)
    rstore.trim_pool()


def test_small_segments_are_not_cached(rstore: ShmStore, reader: ShmStore) -> None:
    ref = rstore.put(sample("float32", (1000,), 1))  # never pooled, so never rewritten
    np.testing.assert_array_equal(reader.get(ref), sample("float32", (1000,), 1))
    assert reader.reader_cache is not None and len(reader.reader_cache) == 0
    rstore.release(ref)


def test_a_closed_cache_lets_go_of_pinned_mappings_with_their_views(
    rstore: ShmStore, reader: ShmStore
) -> None:
    ref = rstore.put(sample("float32", (MIB,), 1))
    view = reader.get(ref)
    cache = reader.reader_cache
    assert cache is not None and len(cache) == 1
    reader.close()  # the pinned entry stays while its view lives ...
    assert len(cache) == 1
    del view  # ... and goes with it, though its file is still linked (no sweeper any more)
    assert len(cache) == 0
    rstore.release(ref)
    rstore.trim_pool()


def test_cached_reader_in_another_process_lets_the_producer_rewrite(rstore: ShmStore) -> None:
    """A worker's case: its cached mapping outlives each task, its views do not."""
    tensors = [sample("uint8", (2 * MIB,), seed) for seed in range(3)]
    code = """
        import sys
        import numpy as np
        from shared.transport import ShmStore, TensorRef
        store = ShmStore(sys.argv[1], reader_cache_bytes=1 << 26)
        for line in sys.stdin:
            view = store.get(TensorRef.model_validate_json(line))
            total = int(view.astype(np.int64).sum())
            del view  # unpinned before the producer hears back (and puts the next one)
            print(total, store.reader_cache.hits, flush=True)
    """
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), str(rstore.root)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env,
    )  # fmt: skip
    ref = None
    try:
        assert child.stdout is not None and child.stdin is not None
        for i, t in enumerate(tensors):
            if ref is not None:
                rstore.release(ref)
            ref = rstore.put(t, detach=True)
            assert rstore.kept_puts == i  # the child's idle mapping does not deny reuse
            child.stdin.write(ref.model_dump_json() + "\n")
            child.stdin.flush()
            total, hits = map(int, child.stdout.readline().split())
            assert total == int(t.astype(np.int64).sum()) and hits == i
    finally:
        child.kill()
        child.wait(timeout=30)
    rstore.release(ref)
    rstore.trim_pool()
