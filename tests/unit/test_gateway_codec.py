"""The gateway's OIP codec against the real tritonclient's own request and response codecs."""

from __future__ import annotations

import base64
import contextlib
import json

import numpy as np
import pytest
import tritonclient.http as th
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.gateway.codec import (
    InferRequest,
    OutputTensor,
    binary_output_names,
    encode_response,
    parse_bytes_elements,
    parse_infer_request,
    serialize_bytes_elements,
)
from producer.gateway.models import fleet_inputs, model_specs, outputs_from_result
from shared.errors import InvalidInput
from shared.settings import load_settings

PNG = base64.b64decode(  # a 1x1 PNG: bytes that are not UTF-8
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


def triton_body(inputs: list[th.InferInput], **kw: object) -> tuple[bytes, str | None]:
    body, json_size = th.InferenceServerClient.generate_request_body(inputs, **kw)
    return body, None if json_size is None else str(json_size)


def test_bytes_elements_round_trip_with_empty_and_binary_elements() -> None:
    elems = [b"", b"hello", PNG, "日本".encode()]
    raw = serialize_bytes_elements(elems)
    assert len(raw) == 4 * len(elems) + sum(len(e) for e in elems)
    assert parse_bytes_elements(raw, "x") == elems


def test_bytes_element_running_past_the_end_is_refused() -> None:
    raw = (10).to_bytes(4, "little") + b"abc"
    with pytest.raises(InvalidInput, match="past the end"):
        parse_bytes_elements(raw, "x")
    with pytest.raises(InvalidInput, match="inside an element's length"):
        parse_bytes_elements(b"\x01\x00", "x")


def test_binary_request_from_tritonclient_decodes_every_input() -> None:
    img = th.InferInput("image", [1], "BYTES")
    img.set_data_from_numpy(np.array([PNG], dtype=object), binary_data=True)
    texts = th.InferInput("texts", [2], "BYTES")
    texts.set_data_from_numpy(np.array(["a dog", "a cat"], dtype=object), binary_data=True)
    floats = th.InferInput("x", [2, 3], "FP32")
    arr = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    floats.set_data_from_numpy(arr, binary_data=True)
    body, hl = triton_body([img, texts, floats], request_id="r-1", priority=2, timeout=5000)
    assert hl is not None  # the binary extension is in use
    req = parse_infer_request(body, hl)
    assert req.id == "r-1"
    assert req.parameters["priority"] == 2 and req.parameters["timeout"] == 5000
    by = {t.name: t for t in req.inputs}
    assert by["image"].data == [PNG]
    assert by["texts"].data == [b"a dog", b"a cat"]
    np.testing.assert_array_equal(by["x"].data, arr)  # bit-exact: raw little-endian floats
    assert by["x"].data.shape == (2, 3)


def test_json_request_from_tritonclient_decodes_nested_data() -> None:
    t = th.InferInput("text", [1], "BYTES")
    t.set_data_from_numpy(np.array(["A man is playing a guitar."], dtype=object), False)
    n = th.InferInput("n", [2, 2], "INT32")
    n.set_data_from_numpy(np.array([[1, -2], [3, 2**31 - 1]], dtype=np.int32), False)
    body, hl = triton_body([t, n])
    assert hl is None
    req = parse_infer_request(body, hl)
    assert req.inputs[0].data == [b"A man is playing a guitar."]
    assert req.inputs[1].data.tolist() == [[1, -2], [3, 2**31 - 1]]


@pytest.mark.parametrize(
    ("body", "header", "match"),
    [
        (b"{not json", None, "not valid JSON"),
        (b"[]", None, "must be a JSON object"),
        (b'{"inputs": []}', None, "non-empty list"),
        (b'{"inputs": [{"name": "a", "datatype": "BF16", "shape": [1], "data": [1]}]}', None,
         "not supported"),
        (b'{"inputs": [{"name": "a", "datatype": "INT8", "shape": [1], "data": [300]}]}', None,
         "not a INT8 value"),
        (b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [2], "data": [1.0]}]}', None,
         "1 elements in data for shape"),
        (b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [-1], "data": []}]}', None,
         "shape must be"),
        (b'{"inputs": [{"name": "a", "datatype": "BYTES", "shape": [1], "data": [7]}]}', None,
         "must be strings"),
        (b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], '
         b'"parameters": {"binary_data_size": 8}}]}', "500", "outside the body"),
        (b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], '
         b'"parameters": {"binary_data_size": 8}}]}abcd', "100", "runs past the end"),
        (b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [1000000, 1000000], '
         b'"data": []}]}', None, "more than"),
        (b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}]}xyz', "74",
         "3 bytes of binary data belong to no input"),
        (b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}]}', "ab",
         "must be an integer"),
    ],
)  # fmt: skip
def test_malformed_requests_are_invalid_input(body: bytes, header: str | None, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        parse_infer_request(body, header)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.one_of(st.none(), st.integers(-5, 400).map(str)))
def test_arbitrary_bytes_never_raise_anything_but_invalid_input(body: bytes, hl: str | None):
    with contextlib.suppress(InvalidInput):
        parse_infer_request(body, hl)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["id", "inputs", "outputs", "parameters"]), json_values))
def test_arbitrary_json_requests_never_raise_anything_but_invalid_input(obj: dict) -> None:
    with contextlib.suppress(InvalidInput):
        req = parse_infer_request(json.dumps(obj).encode(), None)
        binary_output_names(req, ["embedding"])


def test_response_is_read_back_by_tritonclient_in_json_and_binary() -> None:
    emb = (np.arange(384, dtype=np.float32) / 384).reshape(1, 384)
    frames = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    outs = [OutputTensor("embedding", emb), OutputTensor("frames", frames)]
    header = {"model_name": "m", "id": "1"}
    body, hl = encode_response(header, outs, {"frames"})
    assert hl is not None
    res = th.InferenceServerClient.parse_response_body(body, header_length=hl)
    np.testing.assert_array_equal(res.as_numpy("frames"), frames)  # raw bytes: exact
    np.testing.assert_allclose(res.as_numpy("embedding"), emb, rtol=1e-7)  # JSON floats
    assert res.get_output("frames")["parameters"]["binary_data_size"] == frames.nbytes
    body, hl = encode_response(header, outs, set())
    assert hl is None and json.loads(body)["outputs"][1]["shape"] == [3, 4]


def test_requested_outputs_and_binary_flags() -> None:
    req = InferRequest(None, {"binary_data_output": True}, [], None)
    assert binary_output_names(req, ["a", "b"]) == (["a", "b"], {"a", "b"})
    req = InferRequest(None, {}, [], [{"name": "b", "parameters": {"binary_data": True}}])
    assert binary_output_names(req, ["a", "b"]) == (["b"], {"b"})
    req = InferRequest(None, {}, [], [{"name": "zzz"}])
    with pytest.raises(InvalidInput, match="not produced"):
        binary_output_names(req, ["a"])


def test_fleet_inputs_per_model_json_and_binary() -> None:
    specs = {s.modality: s for s in model_specs(load_settings()).values()}
    img_json = th.InferInput("image", [1], "BYTES")
    img_json.set_data_from_numpy(np.array([base64.b64encode(PNG)], dtype=object), False)
    img_bin = th.InferInput("image", [1], "BYTES")
    img_bin.set_data_from_numpy(np.array([PNG], dtype=object), True)
    for inp in (img_json, img_bin):
        body, hl = triton_body([inp])
        inputs, video = fleet_inputs(specs["image"], parse_infer_request(body, hl).inputs)
        assert inputs == {"image_b64": base64.b64encode(PNG).decode()} and video is None
    texts = th.InferInput("texts", [2], "BYTES")
    texts.set_data_from_numpy(np.array(["a", "b"], dtype=object), True)
    body, hl = triton_body([img_bin, texts])
    inputs, _ = fleet_inputs(specs["xmodal"], parse_infer_request(body, hl).inputs)
    assert inputs["texts"] == ["a", "b"]
    raw = th.InferInput("video", [len(PNG)], "UINT8")
    raw.set_data_from_numpy(np.frombuffer(PNG, dtype=np.uint8), True)
    body, hl = triton_body([raw])
    assert fleet_inputs(specs["video"], parse_infer_request(body, hl).inputs) == ({}, PNG)
    bad = th.InferInput("image", [1], "BYTES")
    bad.set_data_from_numpy(np.array(["not base64!"], dtype=object), False)
    body, hl = triton_body([bad])
    with pytest.raises(InvalidInput, match="base64"):
        fleet_inputs(specs["image"], parse_infer_request(body, hl).inputs)
    wrong = th.InferInput("txt", [1], "BYTES")
    wrong.set_data_from_numpy(np.array(["x"], dtype=object), False)
    body, hl = triton_body([wrong])
    with pytest.raises(InvalidInput, match="missing: \\['text'\\]"):
        fleet_inputs(specs["text"], parse_infer_request(body, hl).inputs)


def test_outputs_from_results_have_the_metadata_shapes() -> None:
    specs = {s.modality: s for s in model_specs(load_settings()).values()}
    text = outputs_from_result(specs["text"], {"embedding": [0.5] * 384, "dim": 384})
    assert [(o.name, o.data.shape, o.data.dtype) for o in text] == [
        ("embedding", (1, 384), np.float32)
    ]
    xm = {
        "scores": [0.1, 0.2], "logits": [10.0, 20.0], "probs": [0.3, 0.7],
        "image_embedding": [0.0] * 384, "text_embeddings": np.zeros((2, 384), np.float32),
        "labels": [{"label": "espresso", "index": 967, "probability": 0.9}],
    }  # fmt: skip
    shapes = {o.name: np.shape(o.data) for o in outputs_from_result(specs["xmodal"], xm)}
    assert shapes == {
        "scores": (2,), "logits": (2,), "probs": (2,), "image_embedding": (1, 384),
        "text_embeddings": (2, 384), "labels": (1,), "probabilities": (1,),
    }  # fmt: skip
    for spec in specs.values():  # metadata names every output the mapping produces, in order
        assert [t.name for t in spec.outputs] == spec.output_names
