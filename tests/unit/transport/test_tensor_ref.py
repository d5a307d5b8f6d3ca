"""Tests of TensorRef's wire form (shared/transport/ref.py)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from shared.errors import TensorRefError
from shared.transport import ShmStore, TensorRef
from shared.transport.ref import new_id
from tests.unit.transport.helpers import ref_for


def test_ref_wire_roundtrip(store: ShmStore) -> None:
    ref = store.put(np.zeros((2, 3), np.float16), ttl_s=30)
    d = json.loads(json.dumps(ref.to_dict()))
    assert set(d) == {"kind", "id", "shape", "dtype", "nbytes", "owner", "created_at", "ttl_s"}
    assert d["kind"] == "shm" and d["shape"] == [2, 3] and d["nbytes"] == 12
    assert TensorRef.from_dict(d) == ref
    assert ref.expires_at == ref.created_at + 30


def _good_dict() -> dict[str, Any]:
    return ref_for(new_id(), (2, 3), "float32").to_dict()


@pytest.mark.parametrize(
    "change",
    [
        {"extra": 1},
        {"nbytes": 25},
        {"nbytes": -24},
        {"nbytes": "24"},
        {"nbytes": 24.0},
        {"shape": [2, -3], "nbytes": -24},
        {"shape": [True, 3]},
        {"shape": "2,3"},
        {"shape": [2.0, 3]},
        {"dtype": "bfloat16"},
        {"dtype": "object"},
        {"dtype": "<f4"},
        {"owner": "x"},
        {"owner": "producer:host:-1"},
        {"owner": "producer:a/b:1"},
        {"created_at": "now"},
        {"created_at": float("nan")},
        {"ttl_s": -1.0},
        {"ttl_s": float("inf")},
        {"kind": "inline"},
        {"id": 5},
    ],
    ids=repr,
)
def test_ref_from_dict_rejects(change: dict[str, Any]) -> None:
    with pytest.raises(TensorRefError):
        TensorRef.from_dict({**_good_dict(), **change})


def test_ref_from_dict_rejects_missing_keys_and_non_objects() -> None:
    d = _good_dict()
    for key in d:
        with pytest.raises(TensorRefError, match="missing"):
            TensorRef.from_dict({k: v for k, v in d.items() if k != key})
    for bad in (None, [], "t" + "0" * 32, 42):
        with pytest.raises(TensorRefError):
            TensorRef.from_dict(bad)
