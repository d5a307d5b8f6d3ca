"""Which adapter serves a Hugging Face folder (kind ``hf``), what is refused at load, and
the weights-against-partition check: on tiny random checkpoints (``tests/models/hf_tiny.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.model_kinds import parse_model_options
from shared.settings import DeviceConfig, Settings
from tests.models.hf_tiny import build
from workers.models import adapter_class
from workers.models.hf_auto import HFAutoAdapter
from workers.models.hf_folder import UnsupportedFolder, inspect_folder
from workers.models.hf_partition import (
    ModelTooLarge,
    check_fits,
    host_memory_bytes,
    partition_bytes,
    weight_params,
)
from workers.models.runtime import DeviceRuntime

SERVED = {
    "bert": ("text", "hf-text"),
    "vit-classifier": ("image-labels", "hf-image"),
    "vit": ("image", "hf-image"),
    "clip": ("xmodal", "hf-xmodal"),
    "siglip": ("xmodal", "hf-xmodal"),
    "dual": ("xmodal", "hf-xmodal"),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf-folders")
    for kind in [*SERVED, "gpt2", "t5"]:
        build(root, kind)
    return root


def auto(settings: Settings, runtime: DeviceRuntime, folder: Path) -> HFAutoAdapter:
    cfg = parse_model_options({"kind": "hf", "checkpoint": str(folder), "top_k": 2})
    return HFAutoAdapter(cfg, settings, runtime)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", list(SERVED))
def test_the_folders_config_picks_the_adapter(
    root: Path, settings: Settings, runtime: DeviceRuntime, kind: str
) -> None:
    family, served_by = SERVED[kind]
    assert inspect_folder(root / kind, "m").family == family
    a = auto(settings, runtime, root / kind)
    a.load()
    assert type(a.inner) is adapter_class(served_by)
    assert a.describe()["kind"] == f"hf -> {served_by}"
    request = a.example_inputs(1)[0]
    (out,) = a.run_batch([a.preprocess(a.prepare(request))])
    assert out["model"] == "hf"  # the table's name (these settings do not hold it)
    if kind == "vit-classifier":
        assert len(out["labels"]) == 2  # the hf table's top_k reached the image adapter


@pytest.mark.parametrize(
    ("kind", "found"),
    [("gpt2", "model_type 'gpt2', GPT2Model"), ("t5", "model_type 't5', T5Model")],
)
def test_unsupported_folders_are_refused_at_load(
    root: Path, settings: Settings, runtime: DeviceRuntime, kind: str, found: str
) -> None:
    with pytest.raises(UnsupportedFolder) as err:
        auto(settings, runtime, root / kind).load()
    assert err.value.code == "MODEL_UNSUPPORTED"
    msg = str(err.value)
    assert found in msg and "no adapter serves it" in msg
    assert "supported: text: an encoder AutoModel" in msg and "CLIPModel, SiglipModel" in msg


def test_no_config_and_not_a_folder_are_refused(
    root: Path, settings: Settings, runtime: DeviceRuntime, tmp_path: Path
) -> None:
    with pytest.raises(UnsupportedFolder, match=r"has no config\.json"):
        auto(settings, runtime, tmp_path).load()
    with pytest.raises(UnsupportedFolder, match="is not a folder"):
        auto(settings, runtime, tmp_path / "missing").load()
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Foo"]}))
    with pytest.raises(UnsupportedFolder, match="model_type missing, Foo"):
        auto(settings, runtime, tmp_path).load()


def test_a_kind_refuses_another_familys_folder(
    root: Path, settings: Settings, runtime: DeviceRuntime
) -> None:
    cfg = parse_model_options({"kind": "hf-text", "checkpoint": str(root / "clip")})
    with pytest.raises(UnsupportedFolder) as err:
        adapter_class("hf-text")(cfg, settings, runtime).load()
    assert "kind 'hf-text' serves text folders" in str(err.value)
    assert "CLIPModel (xmodal: kind 'hf-xmodal' on the xmodal modality" in str(err.value)


def test_auto_refuses_a_folder_for_another_modality(
    root: Path, settings: Settings, runtime: DeviceRuntime
) -> None:
    cfg = parse_model_options({"kind": "hf", "checkpoint": str(root / "clip")})
    text = settings.modalities["text"].model_copy(update={"model": "my-clip"})
    s = settings.model_copy(
        update={"models": {**settings.models, "my-clip": cfg},
                "modalities": {**settings.modalities, "text": text}}
    )  # fmt: skip
    with pytest.raises(UnsupportedFolder, match="served on the xmodal modality; this model is "
                       "named by text"):  # fmt: skip
        HFAutoAdapter(cfg, s, runtime).load()  # type: ignore[arg-type]


def test_weight_params_read_from_the_safetensors_header(root: Path) -> None:
    from safetensors.torch import load_file

    for kind in SERVED:
        tensors = load_file(root / kind / "model.safetensors")
        assert weight_params(root / kind) == sum(t.numel() for t in tensors.values())


def test_check_fits_names_both_sizes() -> None:
    assert check_fits("m", 1000, "fp32", 4000, "here") == 4000
    assert check_fits("m", 1000, "fp16", 2000, "here") == 2000
    with pytest.raises(ModelTooLarge) as err:
        check_fits("m", 1000, "fp32", 3999, "memory_fraction 0.1 of 0.0 MiB on the host (cpu)")
    assert err.value.code == "MODEL_TOO_LARGE"
    assert "weights need 4,000 bytes" in str(err.value)
    assert "1,000 parameters in fp32" in str(err.value)
    assert "partition of 3,999 bytes" in str(err.value)


def test_a_folder_too_big_for_the_partition_is_refused_at_load(
    root: Path, settings: Settings
) -> None:
    fraction = 1e-6  # of the host's memory: kilobytes, below every tiny folder's weights
    part, _ = partition_bytes("cpu", fraction)
    assert part == int(host_memory_bytes() * fraction)
    tiny = DeviceRuntime(DeviceConfig(memory_fraction=fraction))
    for kind in ("bert", "vit-classifier", "clip"):
        need = 4 * weight_params(root / kind)
        assert need > part
        with pytest.raises(ModelTooLarge) as err:
            auto(settings, tiny, root / kind).load()
        assert f"weights need {need:,} bytes" in str(err.value)
        assert f"partition of {part:,} bytes" in str(err.value)
        assert "memory_fraction 1e-06 of" in str(err.value) and "on the host (cpu)" in str(
            err.value
        )
