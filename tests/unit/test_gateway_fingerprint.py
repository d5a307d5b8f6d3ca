"""A request's fingerprint (``producer.gateway.fingerprint``) and the id check on it
(``jobs.same_request``): one id is one request; old records without a fingerprint keep
answering their id."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest
import tritonclient.http as th

from producer.gateway.codec import parse_infer_request
from producer.gateway.errors import IdConflict
from producer.gateway.fingerprint import FINGERPRINT_HEX, request_fingerprint
from producer.gateway.jobs import Job, same_request
from producer.gateway.models import ModelSpec, fleet_inputs, model_specs
from shared.settings import load_settings

PNG = base64.b64decode(  # a 1x1 PNG
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)
SPECS = {s.modality: s for s in model_specs(load_settings()).values()}


def fp(spec: ModelSpec, body: bytes, header_len: str | None = None) -> str:
    """The fingerprint the gateway takes of ``body`` POSTed to ``spec`` (as ``_decoded``)."""
    req = parse_infer_request(body, header_len)
    inputs, video = fleet_inputs(spec, req.inputs, req.parameters)
    return request_fingerprint(spec.name, inputs, video)


def text_body(text: str, **extra: Any) -> bytes:
    inputs = [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]
    return json.dumps({"id": "1", "inputs": inputs, **extra}).encode()


def image_body(binary: bool, **parameters: Any) -> tuple[bytes, str | None]:
    img = th.InferInput("image", [1], "BYTES")
    data = PNG if binary else base64.b64encode(PNG)
    img.set_data_from_numpy(np.array([data], dtype=object), binary_data=binary)
    body, size = th.InferenceServerClient.generate_request_body([img], parameters=parameters)
    return body, None if size is None else str(size)


def test_the_same_content_has_the_same_fingerprint_however_it_is_sent() -> None:
    text = SPECS["text"]
    one = fp(text, text_body("cats"))
    assert len(one) == FINGERPRINT_HEX and int(one, 16) >= 0
    assert fp(text, text_body("cats")) == one
    # a retry re-encoded: other whitespace, key order, and scheduling parameters
    spaced = json.dumps(
        {"inputs": [{"data": ["cats"], "shape": [1], "datatype": "BYTES", "name": "text"}]},
        indent=2,
    ).encode()
    assert fp(text, spaced) == one
    sched = text_body("cats", parameters={"priority": 1, "timeout": 5_000_000})
    assert fp(text, sched) == one
    # an image in JSON base64 or as Triton binary data is one file
    image = SPECS["image"]
    assert fp(image, *image_body(False)) == fp(image, *image_body(True))


def test_different_text_model_or_parameters_have_different_fingerprints() -> None:
    text = SPECS["text"]
    cats = fp(text, text_body("cats"))
    assert fp(text, text_body("dogs")) != cats
    assert fp(text, text_body("cats ")) != cats  # the model sees another text
    assert request_fingerprint("other-model", {"text": "cats"}) != cats
    assert request_fingerprint(text.name, {"text": "cats"}) == cats
    image = SPECS["image"]
    assert fp(image, *image_body(True, top_k=3)) != fp(image, *image_body(True))
    assert fp(image, *image_body(True, top_k=3)) != fp(image, *image_body(True, top_k=2))
    assert fp(image, *image_body(True, top_k=3)) == fp(image, *image_body(False, top_k=3))


def test_a_video_is_fingerprinted_by_its_bytes() -> None:
    video = SPECS["video"]
    a = request_fingerprint(video.name, {}, PNG)
    assert request_fingerprint(video.name, {}, bytes(PNG)) == a
    assert request_fingerprint(video.name, {}, PNG + b"\x00") != a
    assert request_fingerprint(video.name, {"top_k": 2}, PNG) != a
    assert request_fingerprint(video.name, {}, None) != a


def _job(**kw: Any) -> Job:
    base: dict[str, Any] = {
        "id": "1",
        "model": "minilm",
        "modality": "text",
        "priority": "normal",
        "created_ms": 1.0,
        "deadline_ms": None,
    }
    return Job(**{**base, **kw})


def test_same_request_checks_the_model_then_the_fingerprint() -> None:
    cats = request_fingerprint("minilm", {"text": "cats"})
    dogs = request_fingerprint("minilm", {"text": "dogs"})
    job = Job.from_json(_job(fingerprint=cats).to_json())
    assert job is not None and job.fingerprint == cats
    assert same_request(job, "minilm", cats) is job
    with pytest.raises(IdConflict, match="in use by a different request") as e:
        same_request(job, "minilm", dogs)
    assert e.value.code == "ID_CONFLICT" and "fresh id" in str(e.value)
    with pytest.raises(IdConflict, match="already names a job of model 'minilm'"):
        same_request(job, "efficientnet-lite0", cats)


def test_a_record_written_before_fingerprints_answers_its_id() -> None:
    old = json.dumps(
        {
            "id": "1",
            "model": "minilm",
            "modality": "text",
            "priority": "normal",
            "created_ms": 1.0,
            "deadline_ms": None,
            "input_refs": [],
        }
    )
    job = Job.from_json(old)
    assert job is not None and job.fingerprint is None
    dogs = request_fingerprint("minilm", {"text": "dogs"})
    assert same_request(job, "minilm", dogs) is job  # today's behaviour: the existing job
    with pytest.raises(IdConflict, match="of model"):
        same_request(job, "efficientnet-lite0", dogs)
