"""The text adapter across starts with the trace cache: the second start loads the traced
encoder instead of building the model, and serves the same embeddings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.settings import Settings
from tests.conftest import REPO
from workers.models import make_adapter
from workers.models.runtime import DeviceRuntime

TEXTS = ["A man is playing a guitar.", "a short one", "The stock market fell sharply today."]


def test_second_start_loads_the_stored_trace(
    settings: Settings, runtime: DeviceRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_TRACE_CACHE_DIR", str(tmp_path / "traced"))
    first = make_adapter("text", settings, runtime)
    first.load()
    assert first.describe()["trace_cache"] == "stored" and first.model is not None
    second = make_adapter("text", settings, runtime)
    second.load()
    assert second.describe()["trace_cache"] == "hit"
    assert second.model is None and second.traced is not None  # no eager model built
    assert second.dim == first.dim == 384 and second.torch_modules() == []
    a = first.run_batch([first.preprocess(first.prepare({"text": t})) for t in TEXTS])
    b = second.run_batch([second.preprocess(second.prepare({"text": t})) for t in TEXTS])
    for x, y in zip(a, b, strict=True):
        assert x["embedding"] == y["embedding"]  # the same TorchScript graph


def test_a_cache_hit_never_imports_the_modeling_code(tmp_path: Path) -> None:
    """What makes the hit fast: transformers' modeling modules (and torch.distributed they
    pull in) are not imported at all; only the tokenizer is."""
    probe = (
        "import sys\n"
        "from shared.settings import load_settings\n"
        "from workers.models import make_adapter\n"
        "from workers.models.runtime import DeviceRuntime\n"
        "s = load_settings()\n"
        "rt = DeviceRuntime(s.modality('text').device); rt.start()\n"
        "a = make_adapter('text', s, rt); a.load()\n"
        "print(a.describe()['trace_cache'], 'transformers.modeling_utils' in sys.modules)\n"
    )
    env = {**os.environ, "FLEET_TRACE_CACHE_DIR": str(tmp_path / "traced")}
    env.pop("FLEET_TRACE_CACHE", None)
    runs = [
        subprocess.run(
            [sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=300,
        )
        for _ in range(2)
    ]
    lines = [r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr for r in runs]
    assert lines == ["stored True", "hit False"], lines
