"""Tracing is off unless a setting turns it on, and then a publish adds nothing."""

from __future__ import annotations

import tomllib
from pathlib import Path

from shared import tracing
from shared.settings import Settings, TracingSettings

REPO = Path(__file__).resolve().parents[2]


def test_off_in_the_shipped_config_and_on_with_one_setting() -> None:
    shipped = tomllib.loads((REPO / "configs" / "fleet.toml").read_text())["tracing"]
    assert not tracing.enabled(Settings(tracing=TracingSettings(**shipped)))
    assert tracing.enabled(Settings(tracing=TracingSettings(otlp_endpoint="http://c:4318")))
    assert tracing.enabled(Settings(tracing=TracingSettings(file="/tmp/spans.jsonl")))


def test_without_a_provider_a_publish_carries_no_traceparent() -> None:
    tracing.reset()
    assert tracing.configure(Settings(), "fleet-producer") is None
    headers: dict[str, object] = {"id": "x"}
    with tracing.producer_span(headers, "text", "x"):
        pass
    tracing.inject(headers, "text", "x")
    assert headers == {"id": "x"}
