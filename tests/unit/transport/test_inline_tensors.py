"""Tests of the inline wire form (shared/transport/inline.py)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from shared.errors import InvalidInput, PayloadTooLarge
from shared.transport import decode_inline, encode_inline
from tests.unit.transport.helpers import DTYPES, SHAPES, sample


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_inline_roundtrip(dtype: str, shape: tuple[int, ...]) -> None:
    a = sample(dtype, shape)
    d = json.loads(json.dumps(encode_inline(a, max_bytes=1 << 20)))
    assert d["kind"] == "inline" and d["nbytes"] == a.nbytes
    b = decode_inline(d, max_bytes=1 << 20)
    assert b.dtype == a.dtype and b.shape == a.shape and b.flags.writeable
    np.testing.assert_array_equal(a, b)


def test_inline_torch_and_views() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3).t()  # non-contiguous
    np.testing.assert_array_equal(decode_inline(encode_inline(t, 1024)), t.numpy())


def test_inline_size_limit() -> None:
    a = np.zeros(1025, np.uint8)
    with pytest.raises(PayloadTooLarge):
        encode_inline(a, max_bytes=1024)
    d = encode_inline(a, max_bytes=4096)
    with pytest.raises(PayloadTooLarge):
        decode_inline(d, max_bytes=1024)
    assert encode_inline(np.zeros(1024, np.uint8), max_bytes=1024)["nbytes"] == 1024


@pytest.mark.parametrize(
    "change",
    [
        {"extra": 1},
        {"kind": "shm"},
        {"dtype": "bfloat16"},
        {"shape": [4]},
        {"shape": [-2, -3]},
        {"shape": [True, 3]},
        {"nbytes": 7},
        {"nbytes": "24"},
        {"b64": "!!!!"},
        {"b64": "AAAA"},
        {"b64": 5},
    ],
    ids=repr,
)
def test_inline_rejects(change: dict[str, Any]) -> None:
    d = encode_inline(np.zeros((2, 3), np.float32), max_bytes=1024)
    with pytest.raises(InvalidInput):
        decode_inline({**d, **change})


def test_inline_rejects_bad_bools_and_non_objects() -> None:
    d = encode_inline(np.array([True, False]), max_bytes=16)
    d["b64"] = "AgA="  # bytes 2, 0
    with pytest.raises(InvalidInput, match="bool"):
        decode_inline(d)
    with pytest.raises(InvalidInput):
        decode_inline([1, 2])
    with pytest.raises(InvalidInput):
        encode_inline(np.zeros(2, np.complex64), max_bytes=100)
