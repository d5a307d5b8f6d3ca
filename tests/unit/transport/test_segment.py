"""Tests of the segment format (shared/transport/segment.py): hostile files refused
through a store, and the pure metadata / encode / view functions.
"""

from __future__ import annotations

import mmap
import time
from dataclasses import replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pytest

from shared.errors import TensorRefError
from shared.transport import ShmStore
from shared.transport.ref import new_id
from shared.transport.segment import (
    SegmentMeta,
    encode,
    view,
    write_ipc_mapped,
)
from tests.unit.transport.helpers import (
    needs_shm,
    ref_for,
    run_py,
    sample,
    segment_meta,
    write_foreign_segment,
)


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


@needs_shm
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


@needs_shm
@pytest.mark.skipif(not pa.Codec.is_available("lz4"), reason="pyarrow built without lz4")
def test_compressed_segment_refused_as_not_zero_copy(store: ShmStore) -> None:
    seg_id = new_id()
    column = pa.array(np.arange(4096, dtype=np.float32))
    write_foreign_segment(store.root, seg_id, column, "float32", (4096,), compression="lz4")
    with pytest.raises(TensorRefError, match="not inside the mapping"):
        store.get(ref_for(seg_id, (4096,), "float32"))


@needs_shm
def test_wrong_column_type_refused(store: ShmStore) -> None:
    seg_id = new_id()
    write_foreign_segment(store.root, seg_id, pa.array([1, 2], pa.int64()), "float64", (2,))
    with pytest.raises(TensorRefError, match="does not store dtype"):
        store.get(ref_for(seg_id, (2,), "float64"))


# -- the pure functions: no /dev/shm, no files ------------------------------------------------
def schema_of(meta: SegmentMeta) -> pa.Schema:
    return pa.schema([pa.field("data", pa.float32())], metadata=meta.to_metadata())


def test_metadata_round_trips_at_a_fixed_width() -> None:
    meta = segment_meta(new_id(), (2, 3), "float32", request="task-1", recycle=True)
    assert SegmentMeta.from_schema(schema_of(meta), meta.id) == meta
    # One shape from one process: the same metadata size whatever the time (a kept mapping
    # of the file fits the next segment).
    later = replace(meta, created_at=meta.created_at + 12345.678901)
    assert len(str(later.to_metadata())) == len(str(meta.to_metadata()))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"id": "t" + "5e" * 16}, "names another id"),  # fixed: the same collection everywhere
        ({"nbytes": 25}, "nbytes does not match"),
        ({"dtype": "bfloat16"}, "not allowed"),
        ({"owner": "nobody"}, "bad owner"),
        ({"pid": -1}, "bad owner"),
        ({"created_at": float("nan")}, "bad times"),
        ({"ttl_s": float("inf")}, "bad times"),
        ({"request": "../x"}, "bad metadata"),
    ],
    ids=repr,
)
def test_metadata_cross_checks(change: dict[str, Any], message: str) -> None:
    seg_id = new_id()
    meta = replace(segment_meta(seg_id, (2, 3), "float32"), **change)
    with pytest.raises(TensorRefError, match=message):
        SegmentMeta.from_schema(schema_of(meta), seg_id)


def test_metadata_with_a_missing_key_or_another_format_is_refused() -> None:
    meta = segment_meta(new_id(), (2,), "int8")
    for drop in ("mmfleet.shape", "mmfleet.format"):
        md = {k: v for k, v in meta.to_metadata().items() if k != drop}
        schema = pa.schema([pa.field("data", pa.int8())], metadata=md)
        with pytest.raises(TensorRefError, match="bad metadata"):
            SegmentMeta.from_schema(schema, meta.id)


def mapped(arr: np.ndarray, meta: SegmentMeta) -> tuple[mmap.mmap, int]:
    """``arr`` encoded and written into an anonymous mapping of exactly its file's size."""
    enc = encode(arr, meta)
    mm = mmap.mmap(-1, enc.size)
    write_ipc_mapped(mm, enc.size, enc)
    return mm, enc.size


@pytest.mark.parametrize("dtype", ["bool", "float16", "int64"])
def test_view_reads_the_encoded_tensor_in_place(dtype: str) -> None:
    arr = sample(dtype, (3, 5), seed=7)
    meta = segment_meta(new_id(), arr.shape, dtype)
    mm, size = mapped(arr, meta)
    now = time.time()
    flat, got = view(meta.ref(), mm, size, renewed_at=now, max_lifetime_s=86400, now=now)
    assert got == meta and flat.size == arr.size
    stored = arr.view(np.uint8) if dtype == "bool" else arr  # bool travels as one byte each
    np.testing.assert_array_equal(flat, stored.reshape(-1))
    # The view's bytes are the mapping's own, not a copy.
    base = np.frombuffer(mm, np.uint8)
    assert np.shares_memory(flat, base)


def test_view_checks_the_lease_and_the_ref() -> None:
    arr = np.arange(6, dtype=np.float32)
    now = time.time()
    meta = segment_meta(new_id(), (6,), "float32", created_at=now - 1000, ttl_s=600.0)
    mm, size = mapped(arr, meta)
    with pytest.raises(TensorRefError, match="expired"):
        view(meta.ref(), mm, size, renewed_at=now, max_lifetime_s=86400, now=now)
    # Bound to a request and renewed 10 s ago: its lease runs.
    bound = replace(meta, request="task-1")
    mm, size = mapped(arr, bound)
    view(bound.ref(), mm, size, renewed_at=now - 10, max_lifetime_s=86400, now=now)
    # ... but never past its lifetime cap.
    with pytest.raises(TensorRefError, match="expired"):
        view(bound.ref(), mm, size, renewed_at=now - 10, max_lifetime_s=900, now=now)
    other = replace(bound, shape=(2, 3)).ref()
    with pytest.raises(TensorRefError, match="ref says"):
        view(other, mm, size, renewed_at=now, max_lifetime_s=86400, now=now)


def test_write_ipc_mapped_refuses_a_mapping_of_another_size() -> None:
    arr = np.zeros(100, np.uint8)
    enc = encode(arr, segment_meta(new_id(), (100,), "uint8"))
    mm = mmap.mmap(-1, enc.size + 64)
    with pytest.raises(OSError, match="bytes into a"):
        write_ipc_mapped(mm, enc.size + 64, enc)
