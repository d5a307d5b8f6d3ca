"""The trace cache (``workers/models/trace_cache.py``) on real TorchScript modules and files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from workers.models import trace_cache

CPU = torch.device("cpu")


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "traced"
    monkeypatch.setenv("FLEET_TRACE_CACHE_DIR", str(root))
    monkeypatch.delenv("FLEET_TRACE_CACHE", raising=False)
    return root


def _module() -> torch.jit.ScriptModule:
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3).eval().requires_grad_(False)
    return torch.jit.trace(lin, torch.randn(2, 4))


def test_a_stored_module_loads_and_computes_the_same(cache: Path) -> None:
    m, x = _module(), torch.randn(5, 4)
    key = trace_cache.cache_key({"model": "x", "torch": torch.__version__})
    assert trace_cache.load(key, CPU) is None  # nothing yet
    assert trace_cache.save(key, m, {"model": "x"})
    assert oct(cache.stat().st_mode & 0o777) == "0o700"
    assert oct((cache / f"{key}.pt").stat().st_mode & 0o777) == "0o600"
    assert not list(cache.glob(".tmp-*"))
    loaded = trace_cache.load(key, CPU)
    assert loaded is not None and torch.equal(loaded(x), m(x))
    assert json.loads((cache / f"{key}.json").read_text())["parts"] == {"model": "x"}


def test_keys_follow_every_part() -> None:
    a = trace_cache.cache_key({"torch": "2.13", "precision": "fp32"})
    assert a == trace_cache.cache_key({"precision": "fp32", "torch": "2.13"})  # order-free
    assert a != trace_cache.cache_key({"torch": "2.13", "precision": "int8"})
    assert a != trace_cache.cache_key({"torch": "2.14", "precision": "fp32"})


def test_a_tampered_archive_is_ignored(cache: Path) -> None:
    key = trace_cache.cache_key({"k": 1})
    assert trace_cache.save(key, _module(), {"k": 1})
    archive = cache / f"{key}.pt"
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    archive.write_bytes(bytes(data))
    assert trace_cache.load(key, CPU) is None


def test_an_unsafe_directory_or_off_disables_the_cache(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = trace_cache.cache_key({"k": 2})
    assert trace_cache.save(key, _module(), {"k": 2})
    os.chmod(cache, 0o777)  # others could plant code there
    assert trace_cache.cache_dir() is None and trace_cache.load(key, CPU) is None
    os.chmod(cache, 0o700)
    assert trace_cache.load(key, CPU) is not None
    monkeypatch.setenv("FLEET_TRACE_CACHE", "0")
    assert trace_cache.load(key, CPU) is None and not trace_cache.save(key, _module(), {})


def test_folder_fingerprint_changes_with_the_weights(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"a" * 10)
    before = trace_cache.folder_fingerprint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"b" * 11)
    assert trace_cache.folder_fingerprint(tmp_path) != before
    assert before[0][:2] == ["model.safetensors", 10]
