"""``configs/fleet.toml`` repeats the typed defaults (``shared/settings/``,
``shared/model_kinds.py``), so reading one or the other tells the same story; only the
priority classes and the modalities, which have no built-in defaults, live in the file alone."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from shared.model_kinds import KINDS
from shared.settings import Settings

REPO = Path(__file__).resolve().parents[2]
RAW = tomllib.loads((REPO / "configs" / "fleet.toml").read_text())


def _same(value: Any, default: Any) -> bool:
    return value == default or (isinstance(default, Path) and Path(value) == default)


def test_every_section_value_is_the_settings_default() -> None:
    checked = 0
    for section, table in RAW.items():
        if section in ("models", "priorities", "modalities"):
            continue
        default = Settings.model_fields[section].get_default(call_default_factory=True)
        for key, value in table.items():
            want = getattr(default, key)
            assert _same(value, want), f"[{section}] {key} = {value!r}, default {want!r}"
            checked += 1
    assert checked > 40  # the file's sections were read, not skipped


def test_every_model_value_is_the_options_default() -> None:
    for name, table in RAW["models"].items():
        cls = KINDS[table["kind"]].options
        for key, value in table.items():
            if key != "kind":
                want = cls.model_fields[key].default
                assert _same(value, want), f"[models.{name}] {key} = {value!r}, default {want!r}"


def test_priorities_and_modalities_come_from_the_file_alone() -> None:
    assert Settings.model_fields["priorities"].get_default(call_default_factory=True) == {}
    assert Settings.model_fields["modalities"].get_default(call_default_factory=True) == {}
    assert set(RAW["priorities"]) == {"realtime", "high", "normal", "bulk"}
