"""Tests of shared.transport: shm segments (real /dev/shm), TensorRef and inline tensors.

Every test that touches /dev/shm uses its own root ``/dev/shm/mmfleet-test-<hex>``, removed
afterwards; a module fixture checks that nothing is left behind. Cross-process checks run in
fresh interpreters (``subprocess``) so that they see only what the transport maps.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pytest

from shared.errors import (
    InvalidInput,
    PayloadTooLarge,
    ShmCapacityError,
    TensorRefError,
    TransportError,
)
from shared.transport import ShmStore, TensorRef, decode_inline, encode_inline
from shared.transport import root as root_mod
from shared.transport import segment as segment_mod
from shared.transport.ref import ALLOWED_DTYPES, hostname, new_id

SHM = Path("/dev/shm")
REPO = Path(__file__).resolve().parents[2]
TEST_PREFIX = "mmfleet-test-"

pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm (Linux)")

DTYPES = sorted(ALLOWED_DTYPES)
SHAPES = [(), (0,), (3, 0, 2), (7,), (2, 3, 4), (1, 1, 1, 5)]


# -- fixtures and helpers ------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _nothing_left_in_shm() -> Iterator[None]:
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


def sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    if dtype.startswith("float"):
        return rng.standard_normal(n).astype(dtype).reshape(shape)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True).reshape(shape)


def run_py(code: str, *args: str, timeout: float = 120) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter; it must print one JSON object as its last line."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def segment_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def write_foreign_segment(
    root: Path, seg_id: str, column: pa.Array, dtype: str, shape: tuple[int, ...], **opts: Any
) -> None:
    """Write an IPC file by hand into the root, with valid mmfleet metadata for ``seg_id``."""
    meta = segment_mod.SegmentMeta(
        id=seg_id,
        shape=shape,
        dtype=dtype,
        nbytes=math.prod(shape) * np.dtype(dtype).itemsize,
        owner=f"producer:{hostname()}:{os.getpid()}",
        pid=os.getpid(),
        pid_start=None,
        created_at=time.time(),
        ttl_s=600.0,
    )
    schema = pa.schema([pa.field("data", column.type)], metadata=meta.to_metadata())
    path = root / f"{seg_id}.arrow"
    with (
        pa.OSFile(str(path), "wb") as f,
        pa.ipc.new_file(f, schema, options=pa.ipc.IpcWriteOptions(**opts)) as w,
    ):
        w.write_batch(pa.record_batch([column], schema=schema))
    os.chmod(path, 0o600)


def ref_for(seg_id: str, shape: tuple[int, ...], dtype: str) -> TensorRef:
    return TensorRef(
        id=seg_id,
        shape=shape,
        dtype=dtype,
        nbytes=math.prod(shape) * np.dtype(dtype).itemsize,
        owner=f"worker:{hostname()}:{os.getpid()}",
        created_at=time.time(),
        ttl_s=600.0,
    )


# -- roundtrips ----------------------------------------------------------------------------
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


# -- zero copy, in another process ---------------------------------------------------------
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


def test_old_pyarrow_refused() -> None:
    code = """
        import json, pyarrow
        pyarrow.__version__ = "14.0.0"
        try:
            import shared.transport
        except ImportError as e:
            print(json.dumps({"error": str(e)}))
        else:
            print(json.dumps({"error": None}))
    """
    r = run_py(code)
    assert r["error"] and "14.0.1" in r["error"] and "CVE-2023-47248" in r["error"]


# -- permissions and the root --------------------------------------------------------------
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


# -- ids and refs --------------------------------------------------------------------------
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


def test_ref_wire_roundtrip(store: ShmStore) -> None:
    ref = store.put(np.zeros((2, 3), np.float16), ttl_s=30)
    d = json.loads(json.dumps(ref.to_dict()))
    assert set(d) == {"kind", "id", "shape", "dtype", "nbytes", "owner", "created_at", "ttl_s"}
    assert d["kind"] == "shm" and d["shape"] == [2, 3] and d["nbytes"] == 12
    assert TensorRef.from_dict(d) == ref
    assert ref.expires_at == ref.created_at + 30


def _good_dict() -> dict[str, Any]:
    return ref_for(new_id(), (2, 3), "float32").to_dict()


@pytest.mark.parametrize(
    "change",
    [
        {"extra": 1},
        {"nbytes": 25},
        {"nbytes": -24},
        {"nbytes": "24"},
        {"nbytes": 24.0},
        {"shape": [2, -3], "nbytes": -24},
        {"shape": [True, 3]},
        {"shape": "2,3"},
        {"shape": [2.0, 3]},
        {"dtype": "bfloat16"},
        {"dtype": "object"},
        {"dtype": "<f4"},
        {"owner": "x"},
        {"owner": "producer:host:-1"},
        {"owner": "producer:a/b:1"},
        {"created_at": "now"},
        {"created_at": float("nan")},
        {"ttl_s": -1.0},
        {"ttl_s": float("inf")},
        {"kind": "inline"},
        {"id": 5},
    ],
    ids=repr,
)
def test_ref_from_dict_rejects(change: dict[str, Any]) -> None:
    with pytest.raises(TensorRefError):
        TensorRef.from_dict({**_good_dict(), **change})


def test_ref_from_dict_rejects_missing_keys_and_non_objects() -> None:
    d = _good_dict()
    for key in d:
        with pytest.raises(TensorRefError, match="missing"):
            TensorRef.from_dict({k: v for k, v in d.items() if k != key})
    for bad in (None, [], "t" + "0" * 32, 42):
        with pytest.raises(TensorRefError):
            TensorRef.from_dict(bad)


def test_shape_dtype_mismatch(store: ShmStore) -> None:
    ref = store.put(np.zeros((3, 4), np.float32))
    for shape, dtype in [((4, 3), "float32"), ((12,), "float32"), ((3, 4), "int32")]:
        with pytest.raises(TensorRefError, match="ref says"):
            store.get(ref_for(ref.id, shape, dtype))
    with pytest.raises(TensorRefError, match="unknown tensor"):
        store.get(ref_for(new_id(), (3, 4), "float32"))


# -- capacity ------------------------------------------------------------------------------
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


# -- reclaiming ----------------------------------------------------------------------------
def test_ttl_expiry_and_gc(store: ShmStore) -> None:
    short = store.put(np.ones(3), ttl_s=10)
    long = store.put(np.ones(3), ttl_s=1000)
    assert store.gc() == []
    assert store.gc(now=time.time() + 100) == [short.id]
    assert [s.id for s in store.ls()] == [long.id]
    assert store.gc(now=time.time() + 10_000) == [long.id]
    assert segment_files(store.root) == []


def test_get_refuses_expired(store: ShmStore) -> None:
    ref = store.put(np.ones(3), ttl_s=0.05)
    time.sleep(0.1)
    with pytest.raises(TensorRefError, match="expired"):
        store.get(ref)


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


# -- recycling -----------------------------------------------------------------------------
MIB = 1 << 20
KIB = 1 << 10


def pool_files(root: Path) -> list[str]:
    return [n for n in segment_files(root) if n.startswith(".pool-")]


@pytest.fixture
def rstore(root: Path) -> ShmStore:
    return ShmStore(root, capacity_bytes=1 << 30, recycle_bytes=64 * MIB)


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


def test_a_small_budget_is_kept_when_claiming_another_stores_file(root: Path) -> None:
    big = ShmStore(root, capacity_bytes=1 << 30, recycle_bytes=64 * MIB)
    big.release(big.put(np.zeros(4 * MIB, np.uint8)))  # a 4 MiB pool file
    tiny = ShmStore(root, capacity_bytes=100_000, recycle_bytes=64 * MIB)
    with pytest.raises(ShmCapacityError, match="budget exceeded"):
        tiny.put(np.zeros(4 * MIB, np.uint8))
    assert segment_files(root) == []  # the claimed file went with the refusal
    big.close()


# -- the reader cache (shared.transport.mapcache) -------------------------------------------
@pytest.fixture
def reader(root: Path) -> Iterator[ShmStore]:
    r = ShmStore(root, capacity_bytes=1 << 30, reader_cache_bytes=64 * MIB)
    yield r
    r.close()


def data_address(view: Any) -> int:
    return int(np.asarray(view).__array_interface__["data"][0])


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


def fork_keeping(
    view: np.ndarray, expected: np.ndarray, before_fork: Callable[[], None] | None = None
) -> Callable[[], bool]:
    """Fork a child that keeps its copy of ``view``. Returns a function that lets the child
    look at it (after whatever the caller did meanwhile) and says whether it still equals
    ``expected``."""
    go_r, go_w = os.pipe()
    res_r, res_w = os.pipe()
    if before_fork is not None:
        before_fork()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.read(go_r, 1)
            code = 0 if np.array_equal(view, expected) else 3
        finally:
            os.write(res_w, bytes([code]))
            os._exit(0)

    def child_still_sees() -> bool:
        os.write(go_w, b"x")
        ok = os.read(res_r, 1) == bytes([0])
        os.waitpid(pid, 0)
        for fd in (go_r, go_w, res_r, res_w):
            os.close(fd)
        return ok

    return child_still_sees


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


def test_growing_a_claimed_file_respects_the_budget(root: Path) -> None:
    store = ShmStore(root, capacity_bytes=2 * MIB + 20 * KIB, recycle_bytes=4 * MIB)
    store.release(store.put(np.zeros(2 * MIB, np.uint8)))
    with pytest.raises(ShmCapacityError, match="budget exceeded"):
        store.put(np.zeros(2 * MIB + 40 * KIB, np.uint8))  # 40 KiB more than the pool file
    assert segment_files(root) == []  # the claimed file is gone with the refused put


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


# -- hostile files -------------------------------------------------------------------------
def test_extension_types_refused(store: ShmStore) -> None:
    # A canonical extension type pyarrow knows (registered): arrow.fixed_shape_tensor.
    storage = pa.array([[1.0, 2.0], [3.0, 4.0]], pa.list_(pa.float32(), 2))
    tensor_type = pa.fixed_shape_tensor(pa.float32(), (2,))
    ext = pa.ExtensionArray.from_storage(tensor_type, storage)
    seg_id = new_id()
    write_foreign_segment(store.root, seg_id, ext, "float32", (2, 2))
    with pytest.raises(TensorRefError, match="extension"):
        store.get(ref_for(seg_id, (2, 2), "float32"))

    # A user-defined extension over a primitive storage, read back while unregistered.
    class Marked(pa.ExtensionType):
        def __init__(self) -> None:
            super().__init__(pa.float32(), "mmfleet.test.marked")

        def __arrow_ext_serialize__(self) -> bytes:
            return b""

        @classmethod
        def __arrow_ext_deserialize__(cls, storage_type: pa.DataType, serialized: bytes) -> Any:
            return cls()

    marked = pa.ExtensionArray.from_storage(Marked(), pa.array([1.0, 2.0, 3.0], pa.float32()))
    for registered in (True, False):
        seg_id = new_id()
        pa.register_extension_type(Marked())
        try:
            write_foreign_segment(store.root, seg_id, marked, "float32", (3,))
        finally:
            if not registered:
                pa.unregister_extension_type("mmfleet.test.marked")
        try:
            with pytest.raises(TensorRefError, match="extension"):
                store.get(ref_for(seg_id, (3,), "float32"))
        finally:
            if registered:
                pa.unregister_extension_type("mmfleet.test.marked")


@pytest.mark.skipif(not pa.Codec.is_available("lz4"), reason="pyarrow built without lz4")
def test_compressed_segment_refused_as_not_zero_copy(store: ShmStore) -> None:
    seg_id = new_id()
    column = pa.array(np.arange(4096, dtype=np.float32))
    write_foreign_segment(store.root, seg_id, column, "float32", (4096,), compression="lz4")
    with pytest.raises(TensorRefError, match="not inside the mapping"):
        store.get(ref_for(seg_id, (4096,), "float32"))


def test_wrong_column_type_refused(store: ShmStore) -> None:
    seg_id = new_id()
    write_foreign_segment(store.root, seg_id, pa.array([1, 2], pa.int64()), "float64", (2,))
    with pytest.raises(TensorRefError, match="does not store dtype"):
        store.get(ref_for(seg_id, (2,), "float64"))


# -- inline --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_inline_roundtrip(dtype: str, shape: tuple[int, ...]) -> None:
    a = sample(dtype, shape)
    d = json.loads(json.dumps(encode_inline(a, max_bytes=1 << 20)))
    assert d["kind"] == "inline" and d["nbytes"] == a.nbytes
    b = decode_inline(d, max_bytes=1 << 20)
    assert b.dtype == a.dtype and b.shape == a.shape and b.flags.writeable
    np.testing.assert_array_equal(a, b)


def test_inline_torch_and_views() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3).t()  # non-contiguous
    np.testing.assert_array_equal(decode_inline(encode_inline(t, 1024)), t.numpy())


def test_inline_size_limit() -> None:
    a = np.zeros(1025, np.uint8)
    with pytest.raises(PayloadTooLarge):
        encode_inline(a, max_bytes=1024)
    d = encode_inline(a, max_bytes=4096)
    with pytest.raises(PayloadTooLarge):
        decode_inline(d, max_bytes=1024)
    assert encode_inline(np.zeros(1024, np.uint8), max_bytes=1024)["nbytes"] == 1024


@pytest.mark.parametrize(
    "change",
    [
        {"extra": 1},
        {"kind": "shm"},
        {"dtype": "bfloat16"},
        {"shape": [4]},
        {"shape": [-2, -3]},
        {"shape": [True, 3]},
        {"nbytes": 7},
        {"nbytes": "24"},
        {"b64": "!!!!"},
        {"b64": "AAAA"},
        {"b64": 5},
    ],
    ids=repr,
)
def test_inline_rejects(change: dict[str, Any]) -> None:
    d = encode_inline(np.zeros((2, 3), np.float32), max_bytes=1024)
    with pytest.raises(InvalidInput):
        decode_inline({**d, **change})


def test_inline_rejects_bad_bools_and_non_objects() -> None:
    d = encode_inline(np.array([True, False]), max_bytes=16)
    d["b64"] = "AgA="  # bytes 2, 0
    with pytest.raises(InvalidInput, match="bool"):
        decode_inline(d)
    with pytest.raises(InvalidInput):
        decode_inline([1, 2])
    with pytest.raises(InvalidInput):
        encode_inline(np.zeros(2, np.complex64), max_bytes=100)


# -- timing (printed, not asserted; run with -s to see) ------------------------------------
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
