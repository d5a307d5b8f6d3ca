"""The identity model (``kind = "identity"``): the benchmark instrument's exact results."""

from __future__ import annotations

import zlib

import pytest

from shared.errors import InvalidInput
from shared.model_kinds import IdentityOptions, parse_model_options
from workers.models import adapter_class
from workers.models.identity import IdentityAdapter, identity_bytes


def _adapter() -> IdentityAdapter:
    adapter = IdentityAdapter(IdentityOptions(kind="identity"), settings=None, runtime=None)  # type: ignore[arg-type]
    adapter.load()
    return adapter


def test_kind_resolves_to_the_identity_adapter() -> None:
    assert adapter_class("identity") is IdentityAdapter
    assert parse_model_options({"kind": "identity"}) == IdentityOptions(kind="identity")


def test_a_text_is_counted_as_its_utf8_bytes() -> None:
    a = _adapter()
    text = "naïve café"
    prepared = a.prepare({"text": text})
    [out] = a.run_batch([a.preprocess(prepared)])
    data = text.encode("utf-8")
    assert out == {"model": "identity", "bytes": len(data), "crc32": zlib.crc32(data)}
    assert out["bytes"] == 12  # two 2-byte characters in 10


def test_other_inputs_are_counted_as_canonical_json() -> None:
    inputs = {"b": [1, 2], "a": "x"}
    assert identity_bytes(inputs) == b'{"a":"x","b":[1,2]}'
    a = _adapter()
    [out] = a.run_batch([a.preprocess(a.prepare(inputs))])
    assert out["crc32"] == zlib.crc32(b'{"a":"x","b":[1,2]}')


def test_a_batch_keeps_order_and_one_bucket() -> None:
    a = _adapter()
    inputs = a.example_inputs(5)
    prepared = [a.prepare(i) for i in inputs]
    assert {p.bucket for p in prepared} == {"default"} == set(a.buckets())
    outs = a.run_batch([a.preprocess(p) for p in prepared])
    assert [o["bytes"] for o in outs] == [len(i["text"].encode()) for i in inputs]


def test_inputs_that_are_not_an_object_are_refused() -> None:
    with pytest.raises(InvalidInput):
        _adapter().prepare(["not", "an", "object"])  # type: ignore[arg-type]
