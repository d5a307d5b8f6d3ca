"""``fleet prepare``: the trace cache filled before any worker starts (what the Dockerfile
runs at build time), and a worker's adapter then starting from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.settings import Settings
from tests.conftest import REPO
from workers.models import make_adapter
from workers.models.runtime import DeviceRuntime


def fleet_prepare(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FLEET_TRACE_CACHE_DIR": str(cache)}
    env.pop("FLEET_TRACE_CACHE", None)
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", "prepare", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )


def test_prepare_stores_the_traces_a_worker_start_then_loads(
    settings: Settings, runtime: DeviceRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "traced"
    first = fleet_prepare(cache, "text", "image")
    assert first.returncode == 0, first.stderr
    lines = [json.loads(x) for x in first.stdout.splitlines()]
    assert [(x["modality"], x["trace_cache"]) for x in lines] == [
        ("text", "stored"),
        ("image", "stored"),
    ]
    assert {x["device"] for x in lines} == {"cpu"}
    assert len(list(cache.iterdir())) >= 2  # one archive (and its record) per model

    again = fleet_prepare(cache, "text")
    assert [json.loads(x)["trace_cache"] for x in again.stdout.splitlines()] == ["hit"]

    monkeypatch.setenv("FLEET_TRACE_CACHE_DIR", str(cache))
    for modality in ("text", "image"):
        adapter = make_adapter(modality, settings, runtime)
        adapter.load()  # as the worker's Engine.start loads it
        assert adapter.describe()["trace_cache"] == "hit", modality


def test_prepare_refuses_an_unknown_modality(tmp_path: Path) -> None:
    out = fleet_prepare(tmp_path / "traced", "audio")
    assert out.returncode == 2
    assert "unknown modality 'audio'" in out.stderr
    assert not (tmp_path / "traced").exists()  # nothing loaded, nothing created
