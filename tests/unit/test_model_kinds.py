"""The model kinds (``shared.model_kinds``): a misspelt key, a bad value or an unknown kind in
a ``[models.<name>]`` table fails when the settings load, with its path; every kind's adapter
path names an adapter of that kind's options."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from shared.model_kinds import KINDS, config_key_path, parse_model_options
from shared.settings import load_settings

REPO = Path(__file__).resolve().parents[2]


def test_each_configured_model_loads_as_its_kinds_options() -> None:
    s = load_settings()
    for name, cfg in s.models.items():
        assert type(cfg) is KINDS[cfg.kind].options, name


def test_misspelt_key_fails_at_load_with_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_MODELS__MINILM__MAX_LENGHT", "128")
    with pytest.raises(ValidationError) as err:
        load_settings()
    (e,) = err.value.errors()
    assert e["type"] == "extra_forbidden"
    assert e["loc"][0] == "models" and e["loc"][1] == "minilm" and e["loc"][-1] == "max_lenght"


def test_bad_value_fails_at_load_with_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_MODELS__VIDEO_EFFICIENTNET_LITE0__SAMPLE_FPS", "-1")
    with pytest.raises(ValidationError) as err:
        load_settings()
    (e,) = err.value.errors()
    assert e["loc"][:2] == ("models", "video-efficientnet-lite0") and e["loc"][-1] == "sample_fps"
    assert e["type"] == "greater_than"


def test_env_strings_are_read_as_the_fields_type(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_MODELS__MINILM__TORCHSCRIPT", "false")
    monkeypatch.setenv("FLEET_MODELS__MINILM__PRECISION", "INT8")
    monkeypatch.setenv("FLEET_MODELS__RESNET18_RANDOM__JPEG_DRAFT", "off")
    s = load_settings()
    # bool("false") would be True: the typed field reads the word
    assert s.models["minilm"].torchscript is False  # type: ignore[attr-defined]
    assert s.models["minilm"].precision == "int8"  # type: ignore[attr-defined]
    assert s.models["resnet18-random"].jpeg_draft is False  # type: ignore[attr-defined]


def test_unknown_kind_and_unknown_precision_are_refused() -> None:
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        parse_model_options({"kind": "bert"})
    with pytest.raises(ValidationError, match="fp32"):
        parse_model_options({"kind": "minilm", "precision": "int4"})


def test_a_key_of_another_kind_is_refused() -> None:
    """``sample_fps`` is a video option: on an image model it is a mistake, not a no-op."""
    with pytest.raises(ValidationError, match="sample_fps"):
        parse_model_options({"kind": "resnet", "sample_fps": 4})
    assert parse_model_options({"kind": "video", "sample_fps": 4}).sample_fps == 4.0  # type: ignore[attr-defined]


def test_xmodal_image_std_must_be_three_positive_values() -> None:
    with pytest.raises(ValidationError):
        parse_model_options({"kind": "xmodal", "image_std": [0.2, 0.0, 0.2]})
    with pytest.raises(ValidationError):
        parse_model_options({"kind": "xmodal", "image_mean": [0.5, 0.5]})


def test_unknown_kind_at_load_names_the_kinds_there_are(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_MODELS__MINILM__KIND", "minlm")
    with pytest.raises(ValidationError) as err:
        load_settings()
    (e,) = err.value.errors()
    assert e["type"] == "union_tag_invalid"
    assert config_key_path(e["loc"]) == "models.minilm"
    assert "'minilm', 'efficientnet', 'resnet', 'video', 'xmodal'" in e["msg"]


def test_every_kinds_adapter_path_is_an_adapter_of_its_options() -> None:
    """The paths are strings (shared never imports workers): import each one here."""
    from workers.models import adapter_class
    from workers.models.base import ModelAdapter

    for kind, entry in KINDS.items():
        cls = adapter_class(kind)
        assert f"{cls.__module__}:{cls.__qualname__}" == entry.adapter
        assert issubclass(cls, ModelAdapter), kind
        assert cls.options_type is entry.options, kind
        assert entry.options.model_fields["kind"].annotation.__args__ == (kind,)


def test_error_path_is_the_key_a_user_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_MODELS__RESNET18_RANDOM__SEEED", "1")
    with pytest.raises(ValidationError) as err:
        load_settings()
    assert config_key_path(err.value.errors()[0]["loc"]) == "models.resnet18-random.seeed"
    assert config_key_path(("redis", "port")) == "redis.port"
