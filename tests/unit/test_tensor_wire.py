"""``shared.tensor_wire``: the tensor wire forms recognised by their kind and exact keys."""

from __future__ import annotations

import numpy as np

from shared.tensor_wire import INLINE, SHM, is_wire, iter_wires
from shared.transport import encode_inline

REF = {"kind": "shm", "id": "t" + "0" * 32, "shape": [2], "dtype": "uint8", "nbytes": 2,
       "owner": "producer:h:1", "created_at": 1.0, "ttl_s": 1.0}  # fmt: skip


def test_a_wire_is_told_by_kind_and_exact_keys() -> None:
    inline = encode_inline(np.zeros(2, np.uint8), 1024)
    assert is_wire(REF) and is_wire(REF, SHM) and not is_wire(REF, INLINE)
    assert is_wire(inline, INLINE) and not is_wire(inline, SHM)
    assert not is_wire({**REF, "extra": 1}) and not is_wire({"kind": "shm", "id": "x"})
    assert not is_wire([REF]) and not is_wire({"kind": "other"})


def test_iter_wires_walks_dicts_and_lists_without_entering_a_wire() -> None:
    inline = encode_inline(np.zeros(2, np.uint8), 1024)
    result = {"a": [REF, {"b": inline}], "c": {"kind": "shm", "nested": REF}, "d": 3}
    assert list(iter_wires(result, SHM)) == [REF, REF]
    assert list(iter_wires(result, INLINE)) == [inline]
    assert len(list(iter_wires(result))) == 3
