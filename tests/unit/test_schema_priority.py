"""The task envelope (``shared.schema``), priority classes (``shared.schema``) and
``FleetClient.envelope`` (validation only: no broker, no I/O)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError

from producer.client import FleetClient
from shared.errors import InvalidInput, InvalidPriority, PayloadTooLarge, UnsupportedModality
from shared.schema import ENVELOPE_KWARG, Priority, TaskEnvelope
from shared.settings import Settings, load_settings


@pytest.fixture(autouse=True)
def _no_fleet_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tests read configs/fleet.toml as shipped, whatever FLEET_* the shell (or a session
    fixture) exported."""
    for name in list(os.environ):
        if name.upper().startswith("FLEET_"):
            monkeypatch.delenv(name)
    yield


@pytest.fixture
def settings() -> Settings:
    return load_settings(redis={"password": "x"})


def client_with(**overrides: Any) -> FleetClient:
    return FleetClient(load_settings(redis={"password": "x"}, **overrides), app=None)


def raw_envelope(**changes: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "v": 1,
        "modality": "text",
        "priority": "realtime",
        "submitted_ms": 1_764_460_800_123.4,
        "deadline_ms": 1_764_460_800_323.4,
        "model": None,
        "inputs": {"text": "A man is playing a guitar."},
    }
    raw.update(changes)
    return raw


# -- TaskEnvelope -----------------------------------------------------------------------


def test_envelope_round_trips_through_json_kwargs() -> None:
    env = TaskEnvelope.from_kwargs({ENVELOPE_KWARG: raw_envelope()})
    wire = json.loads(json.dumps(env.to_kwargs()))
    assert TaskEnvelope.from_kwargs(wire) == env


def test_to_kwargs_holds_the_envelope_under_request() -> None:
    env = TaskEnvelope(modality="image", priority="bulk", inputs={"image_b64": "AAAA"})
    kwargs = env.to_kwargs()
    assert list(kwargs) == ["request"]
    assert kwargs["request"]["modality"] == "image"
    assert kwargs["request"]["v"] == 1
    assert kwargs["request"]["deadline_ms"] is None


def test_envelope_is_frozen() -> None:
    env = TaskEnvelope.from_kwargs({ENVELOPE_KWARG: raw_envelope()})
    with pytest.raises(ValidationError):
        env.priority = "bulk"  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({}, id="missing"),
        pytest.param({"request": "text"}, id="string"),
        pytest.param({"request": [raw_envelope()]}, id="list"),
        pytest.param({"request": None}, id="null"),
        pytest.param(None, id="kwargs-not-a-dict"),
        pytest.param({"request": raw_envelope(extra=1)}, id="extra-key"),
        pytest.param({"request": raw_envelope(v=2)}, id="wrong-version"),
        pytest.param(
            {"request": {k: v for k, v in raw_envelope().items() if k != "inputs"}}, id="no-inputs"
        ),
        pytest.param({"request": raw_envelope(inputs="text")}, id="inputs-not-object"),
    ],
)
def test_malformed_envelope_is_invalid_input(kwargs: Any) -> None:
    with pytest.raises(InvalidInput) as err:
        TaskEnvelope.from_kwargs(kwargs)
    assert type(err.value) is InvalidInput
    assert err.value.code == "INVALID_INPUT"


def test_unknown_modality_is_unsupported_modality() -> None:
    with pytest.raises(UnsupportedModality) as err:
        TaskEnvelope.from_kwargs({"request": raw_envelope(modality="audio")})
    assert err.value.code == "UNSUPPORTED_MODALITY"


def test_invalid_input_message_names_the_bad_field() -> None:
    with pytest.raises(InvalidInput, match="v"):
        TaskEnvelope.from_kwargs({"request": raw_envelope(v=2)})


def test_expired_only_after_the_deadline() -> None:
    env = TaskEnvelope.from_kwargs({"request": raw_envelope(deadline_ms=1000.0)})
    assert not env.expired(now_ms=999.0)
    assert not env.expired(now_ms=1000.0)
    assert env.expired(now_ms=1000.1)


def test_no_deadline_never_expires() -> None:
    env = TaskEnvelope.from_kwargs({"request": raw_envelope(deadline_ms=None)})
    assert not env.expired(now_ms=1e18)


def test_expired_defaults_to_wall_clock_now() -> None:
    now_ms = time.time() * 1000.0
    past = TaskEnvelope.from_kwargs({"request": raw_envelope(deadline_ms=now_ms - 60_000)})
    future = TaskEnvelope.from_kwargs({"request": raw_envelope(deadline_ms=now_ms + 60_000)})
    assert past.expired()
    assert not future.expired()


# -- Priority ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("realtime", Priority.REALTIME),
        ("HIGH", Priority.HIGH),
        ("Normal", Priority.NORMAL),
        ("bUlK", Priority.BULK),
        (Priority.HIGH, Priority.HIGH),
    ],
)
def test_priority_parse_accepts_names_in_any_case(name: Any, expected: Priority) -> None:
    assert Priority.parse(name) is expected


@pytest.mark.parametrize("value", [0, 3, "0", "urgent", "", None, 1.0])
def test_priority_parse_rejects_numbers_and_unknown_names(value: Any) -> None:
    with pytest.raises(InvalidPriority) as err:
        Priority.parse(value)
    assert err.value.code == "INVALID_PRIORITY"


def test_priority_classes_order_most_urgent_first() -> None:
    assert sorted([Priority.BULK, Priority.REALTIME, Priority.NORMAL, Priority.HIGH]) == [
        Priority.REALTIME,
        Priority.HIGH,
        Priority.NORMAL,
        Priority.BULK,
    ]
    assert [p.label for p in Priority] == ["realtime", "high", "normal", "bulk"]


@pytest.mark.parametrize(
    ("priority", "celery_priority", "timeout_s"),
    [
        (Priority.REALTIME, 0, 0.2),
        (Priority.HIGH, 3, 1.0),
        (Priority.NORMAL, 6, 2.0),
        (Priority.BULK, 9, None),
    ],
)
def test_priority_mapping_follows_fleet_toml(
    settings: Settings, priority: Priority, celery_priority: int, timeout_s: float | None
) -> None:
    assert priority.celery_priority(settings) == celery_priority
    assert priority.default_timeout_s(settings) == timeout_s


def test_priority_mapping_follows_overrides() -> None:
    s = load_settings(priorities={"high": {"celery_priority": 2, "timeout_s": 0.5}})
    assert Priority.HIGH.celery_priority(s) == 2
    assert Priority.HIGH.default_timeout_s(s) == 0.5


# -- FleetClient.envelope ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("priority", "timeout_ms"), [("realtime", 200.0), ("high", 1000.0), ("normal", 2000.0)]
)
def test_envelope_deadline_is_submitted_plus_class_timeout(
    priority: str, timeout_ms: float
) -> None:
    before = time.time() * 1000.0
    env = client_with().envelope("text", {"text": "hi"}, priority=priority)
    after = time.time() * 1000.0
    assert before <= env.submitted_ms <= after
    assert env.deadline_ms is not None
    assert env.deadline_ms - env.submitted_ms == pytest.approx(timeout_ms)
    assert env.priority == priority


def test_envelope_explicit_timeout_wins_over_class_default() -> None:
    env = client_with().envelope("text", {"text": "hi"}, priority="realtime", timeout_s=5.0)
    assert env.deadline_ms is not None
    assert env.deadline_ms - env.submitted_ms == pytest.approx(5000.0)


def test_bulk_envelope_has_no_deadline() -> None:
    env = client_with().envelope("image", {"image_b64": "AAAA"}, priority="bulk")
    assert env.deadline_ms is None
    assert not env.expired(now_ms=1e18)


def test_bulk_envelope_with_explicit_timeout_has_deadline() -> None:
    env = client_with().envelope("text", {"text": "hi"}, priority="BULK", timeout_s=3.0)
    assert env.priority == "bulk"
    assert env.deadline_ms is not None
    assert env.deadline_ms - env.submitted_ms == pytest.approx(3000.0)


def test_envelope_is_accepted_by_the_worker_side_parser() -> None:
    env = client_with().envelope("text", {"text": "hi"}, priority="high")
    assert TaskEnvelope.from_kwargs(json.loads(json.dumps(env.to_kwargs()))) == env


def test_envelope_at_inline_limit_is_accepted_and_one_byte_over_is_too_large() -> None:
    client = client_with(limits={"max_inline_bytes": 64})
    overhead = len('{"text":""}')
    client.envelope("text", {"text": "x" * (64 - overhead)})
    with pytest.raises(PayloadTooLarge) as err:
        client.envelope("text", {"text": "x" * (64 - overhead + 1)})
    assert err.value.code == "PAYLOAD_TOO_LARGE"


def test_an_inline_file_over_the_limit_is_refused_with_its_raw_and_base64_sizes() -> None:
    """A 10 MiB image sent inline (the gateway's binary upload is re-encoded so): the
    refusal names the file's size, its base64 size, the limit and the largest file that fits
    (once, it quoted the JSON's 13,981,032 bytes against the limit and nothing else)."""
    from producer.client import image_inputs

    client = client_with()  # [limits] max_inline_bytes: 8 MiB
    inputs = {**image_inputs(bytes(10 * 1024 * 1024)), "top_k": 3}
    with pytest.raises(PayloadTooLarge) as err:
        client.envelope("image", inputs)
    assert err.value.message == (
        "inline inputs are 13,981,042 bytes as JSON (image_b64: a 10,485,760-byte file is "
        "13,981,016 bytes as base64); the limit is 8,388,608 bytes ([limits] "
        "max_inline_bytes): a file of at most 6,291,435 bytes fits"
    )
    fits = image_inputs(bytes(6_291_435))
    client.envelope("image", {**fits, "top_k": 3})
    with pytest.raises(PayloadTooLarge):
        client.envelope("image", {**image_inputs(bytes(6_291_436)), "top_k": 3})


def test_envelope_rejects_unknown_modality() -> None:
    with pytest.raises(UnsupportedModality):
        client_with().envelope("audio", {"text": "hi"})


def test_envelope_rejects_unknown_priority() -> None:
    with pytest.raises(InvalidPriority):
        client_with().envelope("text", {"text": "hi"}, priority="urgent")


@pytest.mark.parametrize("inputs", [["hi"], "hi", None, 3])
def test_envelope_rejects_non_dict_inputs(inputs: Any) -> None:
    with pytest.raises(InvalidInput) as err:
        client_with().envelope("text", inputs)
    assert err.value.code == "INVALID_INPUT"


@pytest.mark.parametrize("timeout_s", [0, 0.0, -1.0, "5", True, [1.0]])
def test_envelope_rejects_non_positive_or_non_numeric_timeout(timeout_s: object) -> None:
    with pytest.raises(InvalidInput) as err:
        client_with().envelope("text", {"text": "hi"}, timeout_s=timeout_s)
    assert err.value.code == "INVALID_INPUT"


def test_envelope_rejects_nan_timeout() -> None:
    with pytest.raises(InvalidInput):
        client_with().envelope("text", {"text": "hi"}, timeout_s=float("nan"))


def test_envelope_rejects_non_json_inputs() -> None:
    with pytest.raises(InvalidInput):
        client_with().envelope("image", {"image_b64": b"\x89PNG"})
