"""Kind ``hf-text``: a tiny random BERT folder (``tests/models/hf_tiny.py``) served by
``HFTextAdapter``; its embeddings checked against transformers' own encoder run by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shared.errors import InvalidInput, ModelError
from shared.model_kinds import parse_model_options
from shared.settings import Settings
from tests.models.hf_tiny import build
from workers.models.hf_text import HFTextAdapter
from workers.models.runtime import DeviceRuntime

TEXTS = [
    "a cat",
    "the big red car sat on the mat at night",
    "a photo of a tabby cat on the mat in the day",
    "coffee",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("hf-text"), "bert")


def adapter(settings: Settings, runtime: DeviceRuntime, folder: Path, **keys: Any) -> HFTextAdapter:
    cfg = parse_model_options({"kind": "hf-text", "checkpoint": str(folder), **keys})
    a = HFTextAdapter(cfg, settings, runtime)  # type: ignore[arg-type]
    a.load()
    return a


def reference(folder: Path, text: str, pooling: str) -> np.ndarray:
    """transformers' encoder on one text (no padding), pooled by hand."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModel.from_pretrained(folder, local_files_only=True).eval()
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state[0]
    v = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[pooling]
    return v.numpy()


def run(a: HFTextAdapter, texts: list[str]) -> list[dict[str, Any]]:
    return a.run_batch([a.preprocess(a.prepare({"text": t})) for t in texts])


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_pooling_matches_transformers(
    settings: Settings, runtime: DeviceRuntime, folder: Path, pooling: str
) -> None:
    raw = adapter(settings, runtime, folder, pooling=pooling, normalize=False)
    unit = adapter(settings, runtime, folder, pooling=pooling)
    text = TEXTS[1]
    want = reference(folder, text, pooling)
    got_raw = np.asarray(run(raw, [text])[0]["embedding"])
    got_unit = np.asarray(run(unit, [text])[0]["embedding"])
    np.testing.assert_allclose(got_raw, want, atol=1e-5)
    assert abs(float(np.linalg.norm(got_raw)) - 1.0) > 0.1  # not normalised: a raw state
    np.testing.assert_allclose(got_unit, want / np.linalg.norm(want), atol=1e-5)
    assert float(np.linalg.norm(got_unit)) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_batch_of_mixed_lengths_equals_one_by_one(
    settings: Settings, runtime: DeviceRuntime, folder: Path, pooling: str
) -> None:
    a = adapter(settings, runtime, folder, pooling=pooling)
    batch = run(a, TEXTS)  # padded to the longest: the mask keeps padding out
    assert len({r["tokens"] for r in batch}) == 4
    for text, got in zip(TEXTS, batch, strict=True):
        alone = run(a, [text])[0]
        np.testing.assert_allclose(got["embedding"], alone["embedding"], atol=1e-5)
        assert got["dim"] == 32 and len(got["embedding"]) == 32  # the config's hidden_size


def test_facts_and_trace(settings: Settings, runtime: DeviceRuntime, folder: Path) -> None:
    a = adapter(settings, runtime, folder)
    facts = a.describe()
    assert facts["model_type"] == "bert" and facts["architectures"] == ["BertModel"]
    assert facts["dim"] == 32
    assert facts["max_length"] == 48  # min(tokenizer 48, config max_position_embeddings 48)
    assert facts["torchscript"] is True and facts["trace_cache"] in ("stored", "hit")
    assert a.buckets()[-1] == "len48"
    assert run(a, [TEXTS[0]])[0]["model"] == "hf-text"  # the table's name (not in settings)


def test_max_length_truncates_and_is_bounded(
    settings: Settings, runtime: DeviceRuntime, folder: Path
) -> None:
    a = adapter(settings, runtime, folder, max_length=6)
    out = run(a, [TEXTS[2], TEXTS[0]])
    assert (out[0]["tokens"], out[0]["truncated"]) == (6, True)
    assert (out[1]["tokens"], out[1]["truncated"]) == (4, False)  # [CLS] a cat [SEP]
    with pytest.raises(ModelError, match=r"max_length 49 outside 3\.\.48"):
        adapter(settings, runtime, folder, max_length=49)


def test_requests_are_checked_as_the_text_modality_does(
    settings: Settings, runtime: DeviceRuntime, folder: Path
) -> None:
    a = adapter(settings, runtime, folder)
    for bad in ({"text": "   "}, {"text": 3}, {"text": "a", "top_k": 1}):
        with pytest.raises(InvalidInput):
            a.prepare(bad)  # type: ignore[arg-type]
