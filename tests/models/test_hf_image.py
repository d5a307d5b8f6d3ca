"""Kind ``hf-image``: a tiny random ViT classifier with its own ``id2label`` and a vision
``AutoModel`` (``tests/models/hf_tiny.py``), served by ``HFImageAdapter`` on the repo's
photos; embeddings and probabilities checked against transformers' own forward."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shared.errors import ImageDecodeError, InvalidInput
from shared.model_kinds import parse_model_options
from shared.settings import Settings
from tests.models.hf_tiny import ID2LABEL, SIDE, build
from workers.models.hf_image import HFImageAdapter
from workers.models.hf_pixels import image_pixels
from workers.models.runtime import DeviceRuntime

IMAGES = Path(__file__).resolve().parents[2] / "data" / "images"
# Different sizes and formats: 451x300 PNG, 600x400 PNG, 640x427 JPEG, 512x512 PNG (grey).
PHOTOS = ["skimage_chelsea.png", "skimage_coffee.png", "skimage_rocket.jpg", "skimage_camera.png"]


def b64(name: str) -> str:
    return base64.b64encode((IMAGES / name).read_bytes()).decode("ascii")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf-image")


def adapter(
    settings: Settings, runtime: DeviceRuntime, folder: Path, **keys: Any
) -> HFImageAdapter:
    cfg = parse_model_options({"kind": "hf-image", "checkpoint": str(folder), **keys})
    a = HFImageAdapter(cfg, settings, runtime)  # type: ignore[arg-type]
    a.load()
    return a


@pytest.fixture(scope="module")
def classifier(settings: Settings, runtime: DeviceRuntime, root: Path) -> HFImageAdapter:
    return adapter(settings, runtime, build(root, "vit-classifier"))


@pytest.fixture(scope="module")
def embedder(settings: Settings, runtime: DeviceRuntime, root: Path) -> HFImageAdapter:
    return adapter(settings, runtime, build(root, "vit"))


def run(a: HFImageAdapter, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return a.run_batch([a.preprocess(a.prepare(r)) for r in requests])


def test_labels_come_from_id2label_and_match_transformers(classifier: HFImageAdapter) -> None:
    from transformers import ViTForImageClassification

    assert classifier.labels == ("tabby cat", "espresso", "space shuttle")
    req = {"image_b64": b64(PHOTOS[0]), "top_k": 3}
    sample = classifier.preprocess(classifier.prepare(req))
    (got,) = classifier.run_batch([sample])
    model = ViTForImageClassification.from_pretrained(classifier.cfg.checkpoint).eval()
    with torch.no_grad():
        out = model(pixel_values=torch.from_numpy(sample[0][None]), output_hidden_states=True)
        # ViT's head reads the final layer-normed class token: the embedding is that, normalised
        cls = model.vit.layernorm(out.hidden_states[-1])[0, 0].numpy()
    probs = torch.softmax(out.logits, 1)[0].numpy()
    np.testing.assert_allclose(got["embedding"], cls / np.linalg.norm(cls), atol=1e-5)
    labels = got["labels"]
    assert [lb["index"] for lb in labels] == list(np.argsort(-probs))
    assert [lb["label"] for lb in labels] == [ID2LABEL[lb["index"]] for lb in labels]
    np.testing.assert_allclose(
        [lb["probability"] for lb in labels], np.sort(probs)[::-1], atol=1e-6
    )
    assert sum(lb["probability"] for lb in labels) == pytest.approx(1.0, abs=1e-6)


def test_top_k_default_is_capped_and_checked(classifier: HFImageAdapter) -> None:
    (default, one, none) = run(
        classifier,
        [{"image_b64": b64(PHOTOS[1])}, {"image_b64": b64(PHOTOS[1]), "top_k": 1},
         {"image_b64": b64(PHOTOS[1]), "top_k": 0}],
    )  # fmt: skip
    assert len(default["labels"]) == 3  # the table's 5, capped at the model's 3 labels
    assert one["labels"] == default["labels"][:1]
    assert none["labels"] == []
    for k in (4, -1, True, 1.0):
        with pytest.raises(InvalidInput, match="top_k"):
            classifier.prepare({"image_b64": b64(PHOTOS[1]), "top_k": k})


def test_batch_of_mixed_sizes_equals_one_by_one(
    classifier: HFImageAdapter, embedder: HFImageAdapter
) -> None:
    for a in (classifier, embedder):
        reqs = [{"image_b64": b64(p)} for p in PHOTOS]
        batch = run(a, reqs)
        for req, got in zip(reqs, batch, strict=True):
            (alone,) = run(a, [req])
            np.testing.assert_allclose(got["embedding"], alone["embedding"], atol=1e-5)
            if a is classifier:
                assert [x["index"] for x in got["labels"]] == [x["index"] for x in alone["labels"]]
                np.testing.assert_allclose(
                    [x["probability"] for x in got["labels"]],
                    [x["probability"] for x in alone["labels"]],
                    atol=1e-6,
                )
            assert got["dim"] == 32 and float(np.linalg.norm(got["embedding"])) == pytest.approx(1)


def test_vision_automodel_gives_its_pooled_output_and_no_labels(embedder: HFImageAdapter) -> None:
    from transformers import ViTModel

    sample = embedder.preprocess(embedder.prepare({"image_b64": b64(PHOTOS[2])}))
    (got,) = embedder.run_batch([sample])
    assert set(got) == {"embedding", "dim", "model"}
    model = ViTModel.from_pretrained(embedder.cfg.checkpoint).eval()
    with torch.no_grad():
        pooled = model(pixel_values=torch.from_numpy(sample[0][None])).pooler_output[0].numpy()
    np.testing.assert_allclose(got["embedding"], pooled / np.linalg.norm(pooled), atol=1e-5)
    with pytest.raises(InvalidInput, match="embeddings only"):
        embedder.prepare({"image_b64": b64(PHOTOS[2]), "top_k": 1})


def test_processor_side_and_normalisation(root: Path) -> None:
    px = image_pixels(build(root, "vit"), "tiny-vit")
    assert px.size == SIDE
    # ViTImageProcessor: rescale 1/255, mean 0.5, std 0.5: 0 -> -1, 255 -> 1
    got = px.norm.apply(np.array([[0.0, 127.5, 255.0]] * 1, dtype=np.float32).T.repeat(3, 1))
    np.testing.assert_allclose(got[:, 0], [-1.0, 0.0, 1.0], atol=1e-6)


def test_bad_images_are_refused_with_the_image_codes(classifier: HFImageAdapter) -> None:
    bad = base64.b64encode((IMAGES / "bad" / "pillow_truncated_jpeg.jpg").read_bytes()).decode()
    with pytest.raises(ImageDecodeError):
        classifier.preprocess(classifier.prepare({"image_b64": bad}))
    with pytest.raises(ImageDecodeError):
        classifier.prepare({"image_b64": base64.b64encode(b"not an image").decode()})


def test_facts(classifier: HFImageAdapter) -> None:
    facts = classifier.describe()
    assert facts["classes"] == 3 and facts["top_k"] == 3 and facts["dim"] == 32
    assert facts["architectures"] == ["ViTForImageClassification"]
    assert facts["image_size"] == SIDE and facts["torchscript"] is True
