"""Fixtures every model-adapter test module shares: a CPU runtime and settings whose
shared-memory root is a fresh directory of the module's own (removed afterwards)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.settings import DeviceConfig, Settings, load_settings
from workers.models.runtime import DeviceRuntime


@pytest.fixture(scope="module")
def shm_root(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    root = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]) / "store"
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def settings(shm_root: Path) -> Settings:
    return load_settings(transport={"shm_root": str(shm_root)})


@pytest.fixture(scope="module")
def runtime() -> DeviceRuntime:
    rt = DeviceRuntime(DeviceConfig())
    rt.start()
    return rt
