"""The text model at ``precision = "int8"`` (real MiniLM weights) against fp32.

The quality targets ``make precision`` reports on all 3,075 texts, held here on every tenth
(the calibration texts are another corpus): cosine per embedding mean >= 0.99 and min >=
0.97, the TorchScript trace of the int8 model equal to its eager run, and the precision in
the worker's facts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from producer.tools.bench.precision import embed
from shared.settings import load_settings
from tests.conftest import DATA
from workers.models import make_adapter
from workers.models.precision import resolve_int8_engine
from workers.models.runtime import DeviceRuntime


def _texts() -> list[str]:
    lines = (DATA / "text" / "botchan_sentences.txt").read_text().splitlines()
    return [t for t in lines if t.strip()][::10]


def _adapter(shm_root: Path, runtime: DeviceRuntime, precision: str) -> object:
    s = load_settings(
        transport={"shm_root": str(shm_root)},
        models={"minilm": {"kind": "minilm", "precision": precision}},
    )
    a = make_adapter("text", s, runtime)
    a.load()
    return a


def test_int8_embeddings_stay_close_to_fp32(
    shm_root: Path, runtime: DeviceRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_TRACE_CACHE", "0")  # traced here, beside the eager int8 model
    texts = _texts()
    fp32 = _adapter(shm_root, runtime, "fp32")
    int8 = _adapter(shm_root, runtime, "int8")
    assert int8.describe()["precision"] == "int8" and fp32.describe()["precision"] == "fp32"
    assert int8.describe()["torchscript"] is True
    assert int8.describe()["int8_engine"] == resolve_int8_engine("auto")  # in the facts
    assert torch.backends.quantized.engine == int8.describe()["int8_engine"]  # and in use
    ref, _ = embed(fp32, runtime, texts, 32)
    out, _ = embed(int8, runtime, texts, 32)
    cos = (ref * out).sum(1)
    assert cos.mean() >= 0.99 and cos.min() >= 0.97, (cos.mean(), cos.min())
    assert not np.allclose(ref, out, atol=1e-4)  # really quantized
    # the trace runs the int8 model: eager and traced agree
    samples = [int8.preprocess(int8.prepare({"text": t})) for t in texts[:8]]
    traced = int8.run_batch(samples)
    int8.traced = None
    eager = int8.run_batch(samples)
    for t, e in zip(traced, eager, strict=True):
        assert max(abs(a - b) for a, b in zip(t["embedding"], e["embedding"], strict=True)) < 1e-5


def test_fp16_refused_on_cpu_at_load(shm_root: Path, runtime: DeviceRuntime) -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        _adapter(shm_root, runtime, "fp16")
