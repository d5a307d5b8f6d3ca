"""The model code the bench's peers run (``producer/tools/bench/peers/model.py``), on real weights.

The peers must run the fleet's own model code, so their figures compare batching and
queueing, not models: a batch through :class:`BatchModel` gives each text the embedding the
adapter gives it alone, and a bad or expired request is refused with its code while its
batch-mates still get theirs.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from producer.tools.bench.peers.model import BatchModel
from shared.settings import Settings, load_settings
from workers.models import make_adapter
from workers.models.runtime import DeviceRuntime


@pytest.fixture(scope="module")
def model(shm_root: Path) -> BatchModel:
    small = load_settings(  # a short warmup
        transport={"shm_root": str(shm_root)},
        modalities={"text": {"batching": {"max_batch_size": 4}}},
    )
    assert small.modality("text").batching.max_batch_size == 4
    return BatchModel("text", small)


def _env(text: str, deadline_ms: float | None = None) -> dict[str, object]:
    return {"modality": "text", "priority": "bulk", "inputs": {"text": text},
            "deadline_ms": deadline_ms}  # fmt: skip


def test_a_batch_gives_each_text_its_own_embedding(
    model: BatchModel, settings: Settings, runtime: DeviceRuntime
) -> None:
    texts = ["a short one", "a considerably longer sentence, so that the batch pads it out"]
    out = model.run([_env(t) for t in texts])
    assert all(o.error is None for o in out)
    alone = make_adapter("text", settings, runtime)
    alone.load()
    for text, o in zip(texts, out, strict=True):
        ref = alone.run_batch([alone.preprocess(alone.prepare({"text": text}))])[0]
        assert o.result is not None and o.result["dim"] == ref["dim"] == 384
        assert (
            max(abs(a - b) for a, b in zip(o.result["embedding"], ref["embedding"], strict=True))
            < 1e-4
        )


def test_bad_and_expired_requests_get_their_codes_and_leave_the_batch(model: BatchModel) -> None:
    past = time.time() * 1000.0 - 1000.0
    out = model.run([_env("fine"), _env("   "), _env("late", past), {"modality": "text"}])
    assert out[0].error is None and out[0].result is not None
    assert [o.error.code for o in out[1:] if o.error] == [
        "INVALID_INPUT",
        "DEADLINE_EXCEEDED",
        "INVALID_INPUT",
    ]
    assert out[1].to_json()["error"]["code"] == "INVALID_INPUT"
    assert out[0].to_json() == {"result": out[0].result}
