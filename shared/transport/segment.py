"""The segment format: one tensor as an Arrow IPC file, written and checked by pure functions.

An Arrow IPC *file* (random-access format, uncompressed) holding one record batch with one
non-nullable column ``data``: the tensor's elements flattened in C order as a primitive array
of the tensor's dtype (``bool`` is stored as ``uint8``, one byte per element, because Arrow's
boolean type is bit-packed and could not be viewed without a copy). Buffers are 8-byte
aligned by the IPC format, enough for every allowed dtype. The schema metadata carries (all
values UTF-8 strings)::

    mmfleet.format      "1"
    mmfleet.id          segment id (== the file name stem)
    mmfleet.shape       JSON list of ints, e.g. "[2, 3]"
    mmfleet.dtype       numpy dtype name
    mmfleet.nbytes      tensor size in bytes (prod(shape) * itemsize)
    mmfleet.owner       "<producer|worker>:<host>:<pid>"
    mmfleet.pid         pid whose death frees the segment; "0" = detached (TTL only)
    mmfleet.pid_start   that process's start time (/proc/<pid>/stat field 22) or "" --
                        guards against a recycled pid keeping an orphan alive
    mmfleet.created_at  Unix epoch seconds (float, fixed width)
    mmfleet.ttl_s       seconds after created_at the segment may be reclaimed (float)
    mmfleet.recycle     "1" when written by a recycling store (its file will be rewritten)
    mmfleet.request     the request (task id) the segment was written for, or "": its TTL
                        then counts from its last renewal, the file's mtime (see
                        :mod:`shared.transport.lifetime`)

The janitor reads that metadata cheaply: parsing the IPC footer touches only the footer's
pages, never the tensor data. A reader builds its numpy array over the data bytes of the
mapping itself (:func:`view`) after checking that they lie inside it, so a compressed or
otherwise non-zero-copy file is refused rather than silently copied.

Security: pyarrow >= 14.0.1 is required (CVE-2023-47248: arbitrary code execution when reading
IPC data with the legacy ``arrow.py_extension_type``); in addition every extension type,
registered or not, is refused.
"""

from __future__ import annotations

import json
import math
import mmap
import re
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.ipc

from shared.errors import TensorRefError
from shared.transport.lifetime import expires_at as lease_expires_at
from shared.transport.lifetime import validate_request_id
from shared.transport.ref import DTYPE_ITEMSIZE, OWNER_PATTERN, TensorRef, numel

__all__ = [
    "COLUMN",
    "FORMAT_VERSION",
    "MIN_PYARROW",
    "Encoded",
    "SegmentMeta",
    "check_column",
    "encode",
    "read_schema",
    "refuse_extension_types",
    "view",
    "write_ipc",
    "write_ipc_mapped",
]

MIN_PYARROW: tuple[int, int, int] = (14, 0, 1)


def _version_tuple(version: str) -> tuple[int, int, int] | None:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


_pa_version = _version_tuple(pa.__version__)
if _pa_version is None or _pa_version < MIN_PYARROW:
    raise ImportError(
        f"shared.transport needs pyarrow >= {'.'.join(map(str, MIN_PYARROW))} "
        f"(CVE-2023-47248, code execution through IPC extension types); found "
        f"{pa.__version__}. Upgrade: pip install 'pyarrow>=14.0.1'"
    )

COLUMN = "data"
FORMAT_VERSION = "1"
_META = "mmfleet."

# Arrow storage type of each allowed dtype. bool -> uint8: see the module docstring.
_ARROW_TYPES: dict[str, pa.DataType] = {
    "bool": pa.uint8(),
    "uint8": pa.uint8(),
    "int8": pa.int8(),
    "int16": pa.int16(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float16": pa.float16(),
    "float32": pa.float32(),
    "float64": pa.float64(),
}


@dataclass(frozen=True)
class SegmentMeta:
    """A segment's schema metadata (see the module docstring); times in epoch seconds."""

    id: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    owner: str
    pid: int
    pid_start: int | None
    created_at: float
    ttl_s: float
    recycle: bool = False  # written by a recycling store: its file will be rewritten
    request: str = ""  # the request it was written for ("": none)

    @property
    def expires_at(self) -> float:
        return self.created_at + self.ttl_s

    def ref(self) -> TensorRef:
        """The ref a message carries for this segment."""
        return TensorRef(
            id=self.id, shape=self.shape, dtype=self.dtype, nbytes=self.nbytes,
            owner=self.owner, created_at=self.created_at, ttl_s=self.ttl_s,
        )  # fmt: skip

    def leased_until(self, renewed_at: float, max_lifetime_s: float) -> float:
        """Its expiry, counting renewals (``renewed_at``: the file's mtime)."""
        return lease_expires_at(
            self.created_at, self.ttl_s, renewed_at, max_lifetime_s, bool(self.request)
        )

    def to_metadata(self) -> dict[str, str]:
        return {
            _META + "format": FORMAT_VERSION,
            _META + "id": self.id,
            _META + "shape": json.dumps(list(self.shape)),
            _META + "dtype": self.dtype,
            _META + "nbytes": str(self.nbytes),
            _META + "owner": self.owner,
            _META + "pid": str(self.pid),
            _META + "pid_start": "" if self.pid_start is None else str(self.pid_start),
            # Fixed width (epoch seconds, microseconds): segments of one shape written by one
            # process have the same size, so a writer's kept mapping fits them (.pool.Kept).
            _META + "created_at": f"{self.created_at:.6f}",
            _META + "ttl_s": repr(self.ttl_s),
            _META + "recycle": "1" if self.recycle else "0",
            _META + "request": self.request,
        }

    @classmethod
    def from_schema(cls, schema: pa.Schema, seg_id: str) -> SegmentMeta:
        """Parse and cross-check the metadata.

        Raises:
            TensorRefError: a field is missing or malformed, or disagrees with another.
        """
        raw = schema.metadata or {}
        try:
            md = {k.decode(): v.decode() for k, v in raw.items() if k.startswith(b"mmfleet.")}
            meta = cls._parse(md)
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            raise TensorRefError(f"segment {seg_id}: bad metadata ({exc})") from None
        meta._cross_check(seg_id)
        return meta

    @classmethod
    def _parse(cls, md: dict[str, str]) -> SegmentMeta:
        if md.get(_META + "format") != FORMAT_VERSION:
            raise ValueError(f"format {md.get(_META + 'format')!r}")
        shape = json.loads(md[_META + "shape"])
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError("shape")
        pid_start = md[_META + "pid_start"]
        meta = cls(
            id=md[_META + "id"],
            shape=tuple(shape),
            dtype=md[_META + "dtype"],
            nbytes=int(md[_META + "nbytes"]),
            owner=md[_META + "owner"],
            pid=int(md[_META + "pid"]),
            pid_start=int(pid_start) if pid_start else None,
            created_at=float(md[_META + "created_at"]),
            ttl_s=float(md[_META + "ttl_s"]),
            recycle=md.get(_META + "recycle", "0") == "1",
            request=md.get(_META + "request", ""),
        )
        if meta.request:
            validate_request_id(meta.request)
        return meta

    def _cross_check(self, seg_id: str) -> None:
        if self.id != seg_id:
            raise TensorRefError(f"segment {seg_id}: metadata names another id")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise TensorRefError(f"segment {seg_id}: dtype {self.dtype[:20]!r} not allowed")
        if self.nbytes != numel(self.shape) * DTYPE_ITEMSIZE[self.dtype]:
            raise TensorRefError(f"segment {seg_id}: nbytes does not match shape and dtype")
        if OWNER_PATTERN.fullmatch(self.owner) is None or self.pid < 0:
            raise TensorRefError(f"segment {seg_id}: bad owner")
        if not (math.isfinite(self.created_at) and math.isfinite(self.ttl_s)):
            raise TensorRefError(f"segment {seg_id}: bad times")


# -- writing ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Encoded:
    """A tensor ready to be written: its IPC schema and batch (over the array's own memory)
    and the exact size of the IPC file in bytes."""

    schema: pa.Schema
    batch: pa.RecordBatch
    size: int


def encode(arr: np.ndarray, meta: SegmentMeta) -> Encoded:
    """The IPC schema and batch of a C-contiguous native array, without copying its data
    (``Array.from_buffers`` wraps the array's memory: the only copy is the write)."""
    arrow_type = _ARROW_TYPES[meta.dtype]
    schema = pa.schema([pa.field(COLUMN, arrow_type, nullable=False)], metadata=meta.to_metadata())
    flat = arr.reshape(-1)
    if meta.dtype == "bool":
        flat = flat.view(np.uint8)
    column = pa.Array.from_buffers(arrow_type, flat.size, [None, pa.py_buffer(flat)])
    batch = pa.record_batch([column], schema=schema)
    sink = pa.MockOutputStream()  # sizes the file without writing it
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)
    return Encoded(schema, batch, int(sink.size()))


def write_ipc(sink: BinaryIO, schema: pa.Schema, batch: pa.RecordBatch) -> None:
    """Write ``batch`` as an IPC file to ``sink`` (a seam for tests that simulate ENOSPC)."""
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)


def write_ipc_mapped(mm: mmap.mmap, size: int, enc: Encoded) -> None:
    """Write ``enc`` as an IPC file into a writable mapping of exactly ``size`` bytes.

    Raises:
        OSError: the file came out at another size than ``size``.
    """
    sink = pa.FixedSizeBufferWriter(pa.py_buffer(mm))
    with pa.ipc.new_file(sink, enc.schema) as writer:
        writer.write_batch(enc.batch)
    if sink.tell() != size:
        raise OSError(f"segment wrote {sink.tell()} bytes into a {size}-byte file")


# -- reading ---------------------------------------------------------------------------------
def refuse_extension_types(schema: pa.Schema, seg_id: str) -> None:
    """TensorRefError if any field has an Arrow extension type, registered or not."""
    for field in schema:
        fmeta = field.metadata or {}
        # A registered extension type deserialises to an ExtensionType instance; an
        # unregistered one to its storage type plus ARROW:extension:* field metadata.
        if isinstance(field.type, pa.BaseExtensionType) or any(
            k.startswith(b"ARROW:extension") for k in fmeta
        ):
            raise TensorRefError(f"segment {seg_id}: Arrow extension types are refused")


def check_column(schema: pa.Schema, seg_id: str, dtype: str) -> None:
    """TensorRefError unless the schema is one ``data`` column of ``dtype``'s storage type."""
    if len(schema) != 1 or schema[0].name != COLUMN:
        raise TensorRefError(f"segment {seg_id}: expected exactly one column {COLUMN!r}")
    if schema[0].type != _ARROW_TYPES[dtype]:
        raise TensorRefError(
            f"segment {seg_id}: column type {schema[0].type} does not store dtype {dtype}"
        )


def read_schema(source: pa.Buffer | pa.MemoryMappedFile, seg_id: str) -> pa.Schema:
    """The schema of the IPC file in ``source`` (only its footer is read).

    Raises:
        TensorRefError: not an IPC file.
    """
    try:
        return pa.ipc.open_file(source).schema
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise TensorRefError(f"segment {seg_id}: not a valid IPC file ({exc})") from None


def view(
    ref: TensorRef,
    mm: mmap.mmap,
    size: int,
    *,
    renewed_at: float,
    max_lifetime_s: float,
    now: float,
) -> tuple[np.ndarray, SegmentMeta]:
    """The flat data array of the IPC file in ``mm`` (no copy) and its metadata, after every
    check: the format, the extension-type guard, ``ref`` against the metadata, the lease
    (``renewed_at``: the file's mtime, ``now``: epoch seconds) and the data's place.

    The array is a view of the mapping itself (not of an Arrow buffer), so that its lifetime is
    the mapping's; the Arrow objects over the mapping are gone when this returns.

    Raises:
        TensorRefError: any check fails (the message names the segment and the reason).
    """
    buf = pa.py_buffer(mm)
    try:
        reader = pa.ipc.open_file(buf)
        schema = reader.schema
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise TensorRefError(f"tensor {ref.id}: not a valid Arrow IPC file ({exc})") from None
    refuse_extension_types(schema, ref.id)
    meta = SegmentMeta.from_schema(schema, ref.id)
    if (meta.shape, meta.dtype, meta.nbytes) != (ref.shape, ref.dtype, ref.nbytes):
        raise TensorRefError(
            f"tensor {ref.id}: ref says {list(ref.shape)} {ref.dtype} {ref.nbytes} B, "
            f"segment holds {list(meta.shape)} {meta.dtype} {meta.nbytes} B"
        )
    check_column(schema, ref.id, ref.dtype)
    # The file's times are authoritative: a forged ref cannot extend a segment's life.
    if now >= meta.leased_until(renewed_at, max_lifetime_s):
        raise TensorRefError(f"tensor {ref.id}: expired (ttl {meta.ttl_s:g} s)")
    offset = _data_offset(reader, buf, ref, size)
    storage = np.dtype(np.uint8 if ref.dtype == "bool" else ref.dtype)
    n = numel(ref.shape)
    del reader, buf
    return np.frombuffer(mm, dtype=storage, count=n, offset=offset if n else 0), meta


def _data_offset(
    reader: pa.ipc.RecordBatchFileReader, buf: pa.Buffer, ref: TensorRef, size: int
) -> int:
    """Offset in bytes of the data buffer inside the mapping ``buf`` (``size`` bytes).

    Raises:
        TensorRefError: not one batch of ``ref``'s length without nulls, or data outside the
            mapping (a compressed body is decompressed into fresh memory: not zero-copy).
    """
    try:
        if reader.num_record_batches != 1:
            raise TensorRefError(f"tensor {ref.id}: expected one record batch")
        column = reader.get_batch(0).column(0)
        if len(column) != numel(ref.shape) or column.null_count != 0 or column.offset != 0:
            raise TensorRefError(f"tensor {ref.id}: column length/nulls do not match")
        data = column.buffers()[1]
        offset = 0 if data is None else data.address - buf.address
        if ref.nbytes and (data is None or data.size < ref.nbytes or
                           not 0 <= offset <= size - ref.nbytes):  # fmt: skip
            raise TensorRefError(f"tensor {ref.id}: data is not inside the mapping")
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise TensorRefError(f"tensor {ref.id}: unreadable ({exc})") from None
    return offset
