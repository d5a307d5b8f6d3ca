"""Helpers the transport's unit tests share (the fixtures are in ``conftest.py``).

Every test that touches /dev/shm uses its own root ``/dev/shm/mmfleet-test-<pid>-<hex>``,
removed afterwards; a module fixture checks that this process left nothing behind (the pid in
the prefix keeps other test runs on the machine out of that check). Cross-process checks run
in fresh interpreters (``subprocess``) so that they see only what the transport maps.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pytest

from shared.transport import TensorRef
from shared.transport.ref import ALLOWED_DTYPES, hostname
from shared.transport.segment import SegmentMeta

SHM = Path("/dev/shm")
REPO = Path(__file__).resolve().parents[3]
TEST_PREFIX = f"mmfleet-test-{os.getpid()}-"
MIB = 1 << 20
KIB = 1 << 10

needs_shm = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm (Linux)")

DTYPES = sorted(ALLOWED_DTYPES)
SHAPES = [(), (0,), (3, 0, 2), (7,), (2, 3, 4), (1, 1, 1, 5)]


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


def pool_files(root: Path) -> list[str]:
    return [n for n in segment_files(root) if n.startswith(".pool-")]


def segment_meta(seg_id: str, shape: tuple[int, ...], dtype: str, **changes: Any) -> SegmentMeta:
    """Valid metadata of a segment ``seg_id`` owned by this process (``changes`` override)."""
    fields: dict[str, Any] = {
        "id": seg_id,
        "shape": shape,
        "dtype": dtype,
        "nbytes": math.prod(shape) * np.dtype(dtype).itemsize,
        "owner": f"producer:{hostname()}:{os.getpid()}",
        "pid": os.getpid(),
        "pid_start": None,
        "created_at": round(time.time(), 6),  # what the metadata keeps (microseconds)
        "ttl_s": 600.0,
    }
    return SegmentMeta(**{**fields, **changes})


def write_foreign_segment(
    root: Path, seg_id: str, column: pa.Array, dtype: str, shape: tuple[int, ...], **opts: Any
) -> None:
    """Write an IPC file by hand into the root, with valid mmfleet metadata for ``seg_id``."""
    meta = segment_meta(seg_id, shape, dtype)
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


def data_address(view: Any) -> int:
    return int(np.asarray(view).__array_interface__["data"][0])


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
