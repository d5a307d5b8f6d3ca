"""Kind ``hf-xmodal``: tiny random CLIP, SigLIP and ViT+BERT dual-encoder folders
(``tests/models/hf_tiny.py``) served by ``HFXModalAdapter``; the logits checked against each
model's own forward (``logits_per_image``)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shared.errors import InvalidInput, PayloadTooLarge
from shared.model_kinds import parse_model_options
from shared.settings import Settings
from shared.transport.inline import decode_inline
from tests.models.hf_tiny import build
from workers.models.hf_xmodal import HFXModalAdapter
from workers.models.runtime import DeviceRuntime

IMAGES = Path(__file__).resolve().parents[2] / "data" / "images"
KINDS = ["clip", "siglip", "dual"]
TEXTS = ["a photo of a tabby cat", "a cup of coffee", "a rocket launch at night in the sky"]


def b64(name: str) -> str:
    return base64.b64encode((IMAGES / name).read_bytes()).decode("ascii")


@pytest.fixture(scope="module")
def adapters(
    settings: Settings, runtime: DeviceRuntime, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, HFXModalAdapter]:
    root = tmp_path_factory.mktemp("hf-xmodal")
    out = {}
    for kind in KINDS:
        cfg = parse_model_options({"kind": "hf-xmodal", "checkpoint": str(build(root, kind))})
        a = HFXModalAdapter(cfg, settings, runtime)  # type: ignore[arg-type]
        a.load()
        out[kind] = a
    return out


def run(a: HFXModalAdapter, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return a.run_batch([a.preprocess(a.prepare(r)) for r in requests])


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_the_models_forward(adapters: dict[str, HFXModalAdapter], kind: str) -> None:
    from transformers import AutoModel

    a = adapters[kind]
    sample = a.preprocess(a.prepare({"image_b64": b64("skimage_chelsea.png"), "texts": TEXTS}))
    (got,) = a.run_batch([sample])
    model = AutoModel.from_pretrained(a.cfg.checkpoint).eval()
    ids, mask = a._pad(sample.ids)
    with torch.no_grad():
        out = model(
            input_ids=ids,
            attention_mask=None if kind == "siglip" else mask,
            pixel_values=torch.from_numpy(sample.pixels[None]),
        )
    want = out.logits_per_image[0].numpy()
    np.testing.assert_allclose(got["logits"], want, rtol=1e-4, atol=1e-5)
    assert got["text_embeddings"]["kind"] == "inline"  # 3 x dim floats: under 16 KiB
    texts = decode_inline(got["text_embeddings"])
    assert texts.shape == (3, got["dim"])
    np.testing.assert_allclose(np.linalg.norm(texts, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(got["scores"], texts @ np.asarray(got["image_embedding"]), atol=1e-5)
    if kind == "siglip":  # each text's own match probability
        np.testing.assert_allclose(got["probs"], 1 / (1 + np.exp(-want)), rtol=1e-4)
        assert got["tokens"] == [len(i) for i in sample.ids]
    else:  # which text fits best
        assert sum(got["probs"]) == pytest.approx(1.0)
        np.testing.assert_allclose(got["probs"], torch.softmax(torch.tensor(want), 0), rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_scores_follow_the_order_of_the_texts(
    adapters: dict[str, HFXModalAdapter], kind: str
) -> None:
    a = adapters[kind]
    img = b64("skimage_coffee.png")
    fwd, rev = run(
        a, [{"image_b64": img, "texts": TEXTS}, {"image_b64": img, "texts": TEXTS[::-1]}]
    )
    np.testing.assert_allclose(fwd["scores"], rev["scores"][::-1], atol=1e-5)
    (one,) = run(a, [{"image_b64": img, "text": TEXTS[1]}])
    assert one["texts"] == 1 and one["scores"][0] == pytest.approx(fwd["scores"][1], abs=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_batch_of_mixed_sizes_equals_one_by_one(
    adapters: dict[str, HFXModalAdapter], kind: str
) -> None:
    a = adapters[kind]
    reqs = [
        {"image_b64": b64("skimage_chelsea.png"), "texts": TEXTS},
        {"image_b64": b64("skimage_rocket.jpg"), "text": "a rocket"},
        {"image_b64": b64("pillow_hopper.jpg"), "texts": TEXTS[:2]},
    ]
    batch = run(a, reqs)
    for req, got in zip(reqs, batch, strict=True):
        (alone,) = run(a, [req])
        np.testing.assert_allclose(got["scores"], alone["scores"], atol=1e-5)
        np.testing.assert_allclose(got["image_embedding"], alone["image_embedding"], atol=1e-5)
        assert got["texts"] == len(got["scores"]) == len(got["truncated"])


def test_long_texts_are_cut_keeping_the_last_token(adapters: dict[str, HFXModalAdapter]) -> None:
    a = adapters["siglip"]  # 16 text positions
    long = " ".join(["the big red car"] * 8)
    (got,) = run(a, [{"image_b64": b64("skimage_chelsea.png"), "texts": [long, "a cat"]}])
    assert got["truncated"] == [True, False]
    assert got["tokens"][0] == 16 == a.max_tokens
    ids = a.prepare({"image_b64": b64("skimage_chelsea.png"), "text": long}).payload.ids[0]
    assert ids[-1] == a.tokenizer.sep_token_id


def test_requests_are_checked_as_the_xmodal_modality_does(
    adapters: dict[str, HFXModalAdapter], settings: Settings
) -> None:
    a = adapters["clip"]
    img = b64("skimage_chelsea.png")
    for bad in (
        {"image_b64": img},
        {"image_b64": img, "text": "a", "texts": ["b"]},
        {"image_b64": img, "texts": []},
        {"image_b64": img, "texts": ["a"] * 17},
        {"image_b64": img, "texts": ["  "]},
        {"texts": ["a cat"]},
        {"image_b64": img, "texts": ["a"], "top_k": 1},
    ):
        with pytest.raises(InvalidInput):
            a.prepare(bad)
    with pytest.raises(PayloadTooLarge):
        a.prepare({"image_b64": img, "text": "a" * (settings.limits.max_text_chars + 1)})
