"""The text adapter (all-MiniLM-L6-v2, real weights): the TorchScript encoder is the eager one."""

from __future__ import annotations

import pytest
import torch

from shared.model_kinds import parse_model_options
from shared.settings import Settings
from tests.conftest import DATA
from workers.models import make_adapter
from workers.models.runtime import DeviceRuntime


def sentences() -> list[str]:
    lines = (DATA / "text" / "botchan_sentences.txt").read_text().splitlines()
    picked = [t for t in lines if t.strip()][:200]
    return sorted(picked, key=len)[::10]  # short to long: widths differ inside the batch


def test_traced_encoder_gives_the_eager_embeddings(
    settings: Settings, runtime: DeviceRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_TRACE_CACHE", "0")  # trace here, beside the eager model
    adapter = make_adapter("text", settings, runtime)
    adapter.load()
    assert adapter.traced is not None and adapter.describe()["torchscript"] is True
    assert adapter.torch_modules() == []  # no Python hooks run inside a trace
    samples = [adapter.preprocess(adapter.prepare({"text": t})) for t in sentences()]
    with torch.inference_mode():
        traced = adapter.run_batch(samples)
        adapter.traced = None
        eager = adapter.run_batch(samples)
        single = adapter.run_batch(samples[-1:])
    assert len({len(ids) for ids, _ in samples}) > 5  # really mixed widths, so padding is tested
    for t, e in zip(traced, eager, strict=True):
        assert max(abs(a - b) for a, b in zip(t["embedding"], e["embedding"], strict=True)) < 1e-5
    # Padding does not change a text's embedding: alone it matches its row in the batch.
    assert (
        max(abs(a - b) for a, b in zip(single[0]["embedding"], eager[-1]["embedding"], strict=True))
        < 1e-4
    )


def test_torchscript_off_runs_eagerly_with_yield_points(
    settings: Settings, runtime: DeviceRuntime
) -> None:
    # as FLEET_MODELS__MINILM__TORCHSCRIPT=false arrives: a string, read as a bool
    cfg = parse_model_options({**settings.models["minilm"].model_dump(), "torchscript": "false"})
    s = settings.model_copy(update={"models": {**settings.models, "minilm": cfg}})
    adapter = make_adapter("text", s, runtime)
    adapter.load()
    assert adapter.traced is None and adapter.torch_modules() == [adapter.model]


@pytest.mark.parametrize(
    ("raw", "want"),
    [("true", True), ("False", False), ("yes", True), ("off", False), ("1", True), ("0", False)],
)
def test_torchscript_reads_booleans_from_strings(raw: str, want: bool) -> None:
    assert parse_model_options({"kind": "minilm", "torchscript": raw}).torchscript is want  # type: ignore[attr-defined]


def test_options_refuse_what_they_cannot_read() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="torchscript"):
        parse_model_options({"kind": "minilm", "torchscript": "maybe"})
    with pytest.raises(ValidationError, match="max_length"):
        parse_model_options({"kind": "minilm", "max_length": "big"})


def test_unknown_input_keys_are_refused(settings: Settings, runtime: DeviceRuntime) -> None:
    from shared.errors import InvalidInput

    adapter = make_adapter("text", settings, runtime)
    with pytest.raises(InvalidInput, match="unknown text input keys"):
        adapter.prepare({"text": "hi", "extra": 1})
