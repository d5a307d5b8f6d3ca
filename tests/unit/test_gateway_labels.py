"""The gateway's image and video labels: metadata, ``labels`` (BYTES) and ``probabilities``
(FP32) read back by the Triton client, and ``parameters.top_k`` into the fleet's inputs."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest
import tritonclient.http as th

from producer.gateway.codec import encode_response, parse_infer_request
from producer.gateway.models import fleet_inputs, model_specs, outputs_from_result
from shared.errors import InvalidInput
from shared.settings import load_settings

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)
LABELS = [
    {"label": "Egyptian cat", "index": 285, "probability": 0.38},
    {"label": "tiger cat", "index": 282, "probability": 0.33},
    {"label": "tabby", "index": 281, "probability": 0.17},
]


def specs() -> dict[str, Any]:
    return {s.modality: s for s in model_specs(load_settings()).values()}


def image_request(**parameters: Any) -> Any:
    img = th.InferInput("image", [1], "BYTES")
    img.set_data_from_numpy(np.array([PNG], dtype=object), binary_data=True)
    body, size = th.InferenceServerClient.generate_request_body([img], parameters=parameters)
    return parse_infer_request(body, None if size is None else str(size))


def test_metadata_lists_labels_and_probabilities_for_labelled_kinds_only() -> None:
    s = specs()
    image = {t.name: (t.datatype, t.shape) for t in s["image"].outputs}
    assert image == {
        "embedding": ("FP32", (1, 1280)),
        "labels": ("BYTES", (-1,)),
        "probabilities": ("FP32", (-1,)),
    }
    video = [t.name for t in s["video"].outputs]
    assert video[-2:] == ["labels", "probabilities"]
    resnet = model_specs(load_settings(modalities={"image": {"model": "resnet18-random"}}))
    assert [t.name for t in resnet["resnet18-random"].outputs] == ["embedding"]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_labels_are_read_back_by_tritonclient(binary: bool) -> None:
    spec = specs()["image"]
    outs = outputs_from_result(spec, {"embedding": [0.0] * 1280, "labels": LABELS, "dim": 1280})
    assert [o.name for o in outs] == spec.output_names
    names = {"labels", "probabilities"} if binary else set()
    body, size = encode_response({"model_name": spec.name, "id": "1"}, outs, names)
    res = th.InferenceServerClient.parse_response_body(body, header_length=size)
    got = [x.decode() if isinstance(x, bytes) else x for x in res.as_numpy("labels").tolist()]
    assert got == ["Egyptian cat", "tiger cat", "tabby"]  # JSON gives str, binary bytes
    np.testing.assert_allclose(res.as_numpy("probabilities"), [0.38, 0.33, 0.17], rtol=1e-6)
    assert res.get_output("labels")["shape"] == [3]


def test_no_labels_asked_gives_empty_outputs() -> None:
    spec = specs()["image"]
    outs = outputs_from_result(spec, {"embedding": [0.0] * 1280, "labels": []})
    body, size = encode_response({"model_name": spec.name, "id": "1"}, outs, set())
    res = th.InferenceServerClient.parse_response_body(body, header_length=size)
    assert res.get_output("labels")["shape"] == [0]
    assert res.as_numpy("probabilities").shape == (0,)


def test_top_k_parameter_reaches_the_fleet_inputs() -> None:
    s = specs()
    req = image_request(top_k=3)
    inputs, video = fleet_inputs(s["image"], req.inputs, req.parameters)
    assert inputs == {"image_b64": base64.b64encode(PNG).decode(), "top_k": 3} and video is None
    req = image_request()
    assert "top_k" not in fleet_inputs(s["image"], req.inputs, req.parameters)[0]


@pytest.mark.parametrize("k", [-1, 1001, "5", True, 2.5])
def test_bad_top_k_is_invalid_input(k: Any) -> None:
    req = image_request(top_k=k)
    with pytest.raises(InvalidInput, match="top_k"):
        fleet_inputs(specs()["image"], req.inputs, req.parameters)


def test_top_k_on_a_model_without_labels_is_refused() -> None:
    settings = load_settings(modalities={"image": {"model": "resnet18-random"}})
    spec = model_specs(settings)["resnet18-random"]
    req = image_request(top_k=3)
    with pytest.raises(InvalidInput, match="no labels"):
        fleet_inputs(spec, req.inputs, req.parameters)
