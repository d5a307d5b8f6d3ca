"""Tests of the ShmStore facade (shared/transport/shm.py): put / get / get_torch / release
round trips on a real /dev/shm root, zero copy seen from another process, refused ids.
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from shared.errors import InvalidInput, TensorRefError
from shared.transport import ShmStore, TensorRef
from shared.transport.ref import new_id
from tests.unit.transport.helpers import (
    DTYPES,
    MIB,
    SHAPES,
    needs_shm,
    ref_for,
    run_py,
    sample,
    segment_files,
)

pytestmark = needs_shm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_roundtrip(store: ShmStore, dtype: str, shape: tuple[int, ...]) -> None:
    a = sample(dtype, shape)
    ref = store.put(a)
    assert (ref.shape, ref.dtype, ref.nbytes) == (shape, dtype, a.nbytes)
    # Through the wire form, as a worker receives it.
    b = store.get(json.loads(json.dumps(ref.to_dict())))
    assert b.dtype == a.dtype and b.shape == a.shape
    np.testing.assert_array_equal(a, b)
    assert not b.flags.writeable
    assert store.release(ref) is True
    assert segment_files(store.root) == []


def test_roundtrip_noncontiguous_foreign_order_and_scalars(store: ShmStore) -> None:
    base = sample("float64", (6, 8))
    cases = [
        base[:, ::2],  # strided view
        np.asfortranarray(base),  # Fortran order
        base.astype(">f8"),  # big-endian: stored native
        np.float32(2.5),  # numpy scalar -> 0-d
        np.array(7, dtype=np.int64),  # 0-d array
    ]
    for a in cases:
        b = store.get(store.put(a))
        np.testing.assert_array_equal(np.asarray(a), b)
        assert b.shape == np.shape(a) and b.dtype.isnative


def test_torch_tensors_in_and_out(store: ShmStore) -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(24, dtype=torch.float32, requires_grad=True).reshape(2, 3, 4)
    ref = store.put(t)  # duck-typed: detach().cpu().numpy()
    assert ref.shape == (2, 3, 4) and ref.dtype == "float32"
    out = store.get_torch(ref)
    assert torch.equal(out, t.detach())
    assert store.get_torch(store.put(torch.tensor([True, False]))).dtype == torch.bool
    with pytest.raises(InvalidInput, match="bfloat16"):
        store.put(torch.zeros(3, dtype=torch.bfloat16))


def test_unsupported_inputs(store: ShmStore) -> None:
    for bad in ([1, 2, 3], "abc", np.zeros(3, np.complex64), np.array(["a"]), np.zeros(2, "O")):
        with pytest.raises(InvalidInput):
            store.put(bad)
    with pytest.raises(ValueError):
        store.put(np.zeros(3), ttl_s=0)
    with pytest.raises(ValueError):
        store.put(np.zeros(3), owner="../etc/passwd")
    assert segment_files(store.root) == []


def test_get_view_is_read_only_and_survives_release(store: ShmStore) -> None:
    a = sample("int32", (1000,))
    ref = store.put(a)
    view = store.get(ref)
    with pytest.raises(ValueError):
        view[0] = 1
    store.release(ref)
    assert store.release(ref) is False  # idempotent
    np.testing.assert_array_equal(view, a)  # the mapping outlives the file name
    with pytest.raises(TensorRefError, match="unknown tensor"):
        store.get(ref)


def test_get_torch_is_copy_on_write_and_warning_free(store: ShmStore) -> None:
    pytest.importorskip("torch")
    a = sample("float32", (256, 256))
    ref = store.put(a)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the non-writable-array warning would fail here
        t = store.get_torch(ref)
    t.add_(1.0)  # in place: private pages only, no SIGSEGV, segment untouched
    np.testing.assert_array_equal(store.get(ref), a)
    np.testing.assert_allclose(t.numpy(), a + 1.0)


ZERO_COPY_CHILD = """
    import json, sys, warnings
    import numpy as np, pyarrow as pa
    from shared.transport import ShmStore, TensorRef

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    def regions(path):
        out = []
        for line in open("/proc/self/maps"):
            if line.rstrip().endswith(path) or line.rstrip().endswith(path + " (deleted)"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                out.append((lo, hi))
        return out

    store = ShmStore(sys.argv[1], capacity_bytes=1 << 30)
    ref = TensorRef.from_dict(json.loads(sys.argv[2]))
    path = str(store.root / (ref.id + ".arrow"))
    pool0, anon0, shmem0 = pa.total_allocated_bytes(), status("RssAnon"), status("RssShmem")
    arr = store.get(ref)
    pool1 = pa.total_allocated_bytes()
    checksum = float(arr.sum(dtype=np.float64))  # touches every page of the data
    anon1, shmem1 = status("RssAnon"), status("RssShmem")
    addr = arr.ctypes.data
    inside = any(lo <= addr and addr + arr.nbytes <= hi for lo, hi in regions(path))
    # np.shares_memory against an independent raw view of the same mapped region.
    lo, hi = next((lo, hi) for lo, hi in regions(path) if lo <= addr < hi)
    import ctypes
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * (hi - lo)).from_address(lo))
    shares = bool(np.shares_memory(arr, raw))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = store.get_torch(ref)
    taddr = t.data_ptr()
    t_inside = any(lo <= taddr and taddr + arr.nbytes <= hi for lo, hi in regions(path))
    print(json.dumps({
        "pool_delta": pool1 - pool0, "anon_delta": anon1 - anon0, "shmem_delta": shmem1 - shmem0,
        "inside": inside, "shares": shares, "t_inside": t_inside, "checksum": checksum,
        "writeable": bool(arr.flags.writeable), "shape": list(arr.shape),
    }))
"""


def test_zero_copy_in_another_process(store: ShmStore) -> None:
    a = np.random.default_rng(1).standard_normal((16, 1024, 1024), dtype=np.float32)  # 64 MiB
    ref = store.put(a)
    r = run_py(ZERO_COPY_CHILD, str(store.root), json.dumps(ref.to_dict()))
    assert r["inside"] and r["shares"] and r["t_inside"]
    assert r["pool_delta"] == 0  # pyarrow allocated nothing
    assert r["anon_delta"] < 8 * 2**20  # reading all 64 MiB grew private memory by < 8 MiB
    assert r["shmem_delta"] > 32 * 2**20  # ... because the pages are the shared segment's
    assert r["checksum"] == pytest.approx(float(a.sum(dtype=np.float64)))
    assert r["writeable"] is False and r["shape"] == [16, 1024, 1024]


def test_arrow_uses_the_fork_safe_system_allocator() -> None:
    r = run_py(
        "import json, shared.transport, pyarrow as pa; "
        "print(json.dumps({'pool': pa.default_memory_pool().backend_name}))"
    )
    assert r == {"pool": "system"}


def test_import_does_not_load_torch() -> None:
    r = run_py(
        "import sys, json, shared.transport; print(json.dumps({'torch': 'torch' in sys.modules}))"
    )
    assert r == {"torch": False}


BAD_IDS = [
    "../x",
    "t" + "0" * 31 + "/",
    "/etc/passwd",
    "t" + "0" * 31,  # too short
    "t" + "0" * 33,  # too long
    "T" + "0" * 32,
    "t" + "A" * 32,  # upper-case hex
    "t" + "0" * 32 + "\n",
    "t" + "0" * 30 + "/.",
    "../" + "t" + "0" * 32,
    "",
]


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_bad_ids_refused(store: ShmStore, bad: str) -> None:
    good = store.put(np.ones(2)).to_dict()
    with pytest.raises(TensorRefError):
        store.get({**good, "id": bad})
    with pytest.raises(TensorRefError):
        store.release(bad)
    with pytest.raises(TensorRefError):
        store.release({**good, "id": bad})
    with pytest.raises(TensorRefError):
        TensorRef.from_dict({**good, "id": bad})


def test_shape_dtype_mismatch(store: ShmStore) -> None:
    ref = store.put(np.zeros((3, 4), np.float32))
    for shape, dtype in [((4, 3), "float32"), ((12,), "float32"), ((3, 4), "int32")]:
        with pytest.raises(TensorRefError, match="ref says"):
            store.get(ref_for(ref.id, shape, dtype))
    with pytest.raises(TensorRefError, match="unknown tensor"):
        store.get(ref_for(new_id(), (3, 4), "float32"))


def test_get_refuses_expired(store: ShmStore) -> None:
    ref = store.put(np.ones(3), ttl_s=0.05)
    time.sleep(0.1)
    with pytest.raises(TensorRefError, match="expired"):
        store.get(ref)


def test_a_janitor_thread_and_puts_share_a_store(rstore: ShmStore) -> None:
    """A worker's janitor runs gc() on the store its inference threads put to."""
    errors: list[BaseException] = []
    stop = threading.Event()

    def collect() -> None:
        while not stop.is_set():
            try:
                rstore.gc()
                ShmStore(rstore.root).trim_pool()
            except BaseException as exc:
                errors.append(exc)

    t = threading.Thread(target=collect)
    t.start()
    try:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            rstore.release(rstore.put(sample("uint8", (2 * MIB,), 1)))
    except BaseException as exc:
        errors.append(exc)
    finally:
        stop.set()
        t.join()
    assert errors == []
    rstore.trim_pool()


TIMING_CHILD = """
    import json, sys, time
    from shared.transport import ShmStore, TensorRef
    store = ShmStore(sys.argv[1], capacity_bytes=1 << 31)
    out = {}
    for d in json.loads(sys.argv[2]):
        ref = TensorRef.from_dict(d)
        best = best_t = float("inf")
        for _ in range(5):
            t0 = time.perf_counter(); a = store.get(ref); t1 = time.perf_counter()
            t = store.get_torch(ref); t2 = time.perf_counter()
            best, best_t = min(best, t1 - t0), min(best_t, t2 - t1)
            del a, t
        out[ref.id] = [best, best_t]
    print(json.dumps(out))
"""


@pytest.mark.bench
def test_timing_report(root: Path) -> None:
    store = ShmStore(root, capacity_bytes=1 << 31)
    rows, refs = [], []
    for mib in (1, 16, 128):
        a = np.random.default_rng(0).standard_normal(mib * 2**18, dtype=np.float32)
        put_s, copy_s = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            ref = store.put(a)
            put_s.append(time.perf_counter() - t0)
            store.release(ref)
            t0 = time.perf_counter()
            b = a.copy()
            copy_s.append(time.perf_counter() - t0)
            del b
        ref = store.put(a)
        refs.append(ref)
        rows.append((mib, ref.id, min(put_s), min(copy_s)))
    got = run_py(TIMING_CHILD, str(root), json.dumps([r.to_dict() for r in refs]))
    print("\nsize     put       get (other proc)  get_torch (other proc)  numpy copy")
    for mib, seg_id, put_t, copy_t in rows:
        get_t, torch_t = got[seg_id]
        print(
            f"{mib:>4} MiB {put_t * 1e3:8.2f} ms {get_t * 1e3:10.3f} ms"
            f" {torch_t * 1e3:16.3f} ms {copy_t * 1e3:14.2f} ms"
        )
