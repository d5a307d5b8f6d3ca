"""``fleet shm ls``: what an operator reads about each segment."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from producer.cli import app
from shared.transport import ShmStore


@pytest.fixture
def shm_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = Path("/dev/shm") / f"mmfleet-test-cli-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("FLEET_TRANSPORT__SHM_ROOT", str(root))
    yield root
    for f in root.glob("*") if root.exists() else []:
        f.unlink()
    if root.exists():
        root.rmdir()


def test_shm_ls_tells_detached_segments_from_owned_ones(shm_root: Path) -> None:
    store = ShmStore(root=shm_root)
    owned = store.put(np.zeros(1000, dtype=np.float32))  # owned by this (live) process
    detached = store.put(np.ones(10, dtype=np.uint8), detach=True)
    out = CliRunner().invoke(app, ["shm", "ls"])
    assert out.exit_code == 0, out.output
    lines = {line.split()[0]: line for line in out.output.splitlines() if line.startswith("t")}
    assert "owner_alive=True" in lines[owned.id] and str(os.getpid()) in lines[owned.id]
    assert lines[detached.id].endswith("detached")
    assert "4000 B" in lines[owned.id] and "10 B" in lines[detached.id]
    assert out.output.splitlines()[-1].startswith("2 segments")


def test_shm_ls_counts_released_files_kept_for_reuse(shm_root: Path) -> None:
    store = ShmStore(root=shm_root, recycle_bytes=8 << 20)
    store.release(store.put(np.zeros(1 << 18, dtype=np.float32)))  # 1 MiB + metadata: pooled
    [pooled] = [p for p in shm_root.iterdir() if p.name.startswith(".pool-")]
    out = CliRunner().invoke(app, ["shm", "ls"])
    assert out.exit_code == 0, out.output
    last = out.output.splitlines()[-1]
    assert last.startswith("0 segments, ") and f"{pooled.stat().st_size} bytes: released" in last


def test_shm_ls_and_gc_name_the_request_a_video_input_was_sent_for(
    shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # explicit credentials: gc's renewal pass would connect only for an input near its
    # lease's end, and none is
    monkeypatch.setenv("FLEET_REDIS__PASSWORD", "unused")
    store = ShmStore(root=shm_root)
    bound = store.put(np.ones(10, dtype=np.uint8), detach=True, request_id="req-42")
    out = CliRunner().invoke(app, ["shm", "ls"])
    assert out.exit_code == 0, out.output
    [line] = [ln for ln in out.output.splitlines() if ln.startswith(bound.id)]
    assert line.endswith("detached  request=req-42")
    gc = CliRunner().invoke(app, ["shm", "gc"])
    assert gc.exit_code == 0, gc.output
    assert f"kept {bound.id} (10 B): the input of request req-42: renewed" in gc.output


def test_shm_gc_with_no_redis_to_ask_removes_lapsed_inputs_and_renews_none(
    shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After ``fleet down`` nothing can say which requests are final: a lapsed input goes
    (it used to be renewed for another lease), a live one is left to run out."""
    from tests.conftest import free_port_block

    monkeypatch.setenv("FLEET_REDIS__PASSWORD", "unused")
    monkeypatch.setenv("FLEET_REDIS__PORT", str(free_port_block(1)))  # nothing listens
    store = ShmStore(root=shm_root)
    lapsed = store.put(np.ones(10, dtype=np.uint8), detach=True, request_id="r-1", ttl_s=0.5)
    live = store.put(np.ones(10, dtype=np.uint8), detach=True, request_id="r-2", ttl_s=15)
    time.sleep(0.6)  # r-1's lease lapsed: a renewal now would keep it another 0.5 s
    mtime = (shm_root / f"{live.id}.arrow").stat().st_mtime  # due: 15 s < 2 janitor intervals
    gc = CliRunner().invoke(app, ["shm", "gc"])
    assert gc.exit_code == 0, gc.output
    assert gc.output.startswith(f"removed 1 segment(s): {lapsed.id}\n"), gc.output
    assert "Redis could not tell which requests are final" in gc.output
    assert f"kept {live.id} (10 B): the input of request r-2" in gc.output
    assert (shm_root / f"{live.id}.arrow").stat().st_mtime == mtime  # not renewed
