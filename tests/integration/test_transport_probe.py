"""A tensor reaches a worker through /dev/shm or inline, and the worker reads all of it."""

from __future__ import annotations

import numpy as np
import pytest

from producer.client import FleetClient
from shared.transport import encode_inline
from workers.probe import PROBE_TASK, byte_checksum

pytestmark = pytest.mark.integration


def probe(client: FleetClient, wire: dict) -> dict:
    res = client.app.send_task(PROBE_TASK, kwargs={"tensor": wire}, queue="text")
    return res.get(timeout=60)


def test_tensor_through_shm_is_read_whole_by_the_worker(client: FleetClient) -> None:
    arr = np.arange(4 * 1024 * 1024, dtype=np.float32).reshape(1024, 4096)  # 16 MiB
    ref = client.shm().put(arr, detach=True)
    try:
        out = probe(client, ref.to_dict())
    finally:
        client.shm().release(ref)
    assert out["kind"] == "shm" and out["nbytes"] == arr.nbytes
    assert out["shape"] == [1024, 4096] and out["dtype"] == "float32"
    assert out["checksum"] == byte_checksum(arr)  # every byte arrived as sent


def test_tensor_inline_gives_the_same_answer(client: FleetClient) -> None:
    arr = np.linspace(-1, 1, 10_000, dtype=np.float64)
    out = probe(client, encode_inline(arr, max_bytes=1 << 20))
    assert out["kind"] == "inline" and out["nbytes"] == arr.nbytes
    assert out["checksum"] == byte_checksum(arr)


def test_a_path_instead_of_an_id_is_refused(client: FleetClient) -> None:
    wire = {"kind": "shm", "id": "../../etc/passwd", "shape": [1], "dtype": "uint8",
            "nbytes": 1, "owner": "producer:x:1", "created_at": 0.0, "ttl_s": 60.0}  # fmt: skip
    res = client.app.send_task(PROBE_TASK, kwargs={"tensor": wire}, queue="text")
    with pytest.raises(Exception) as err:
        res.get(timeout=60)
    assert "TENSOR_REF_INVALID" in str(err.value.args)
