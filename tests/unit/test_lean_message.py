"""The channel's lean kombu message (``workers.consumer.channel.Message``): the same message
kombu builds, with its body decoded once; anything else is kombu's own."""

from __future__ import annotations

import base64
import uuid
from typing import Any

import orjson
import pytest
from kombu.transport.virtual import Message as KombuMessage
from kombu.transport.virtual.base import Base64

from shared.celery_app import use_fast_json
from workers.consumer.channel import Message

FIELDS = ("delivery_tag", "content_type", "content_encoding", "delivery_info", "headers",
          "properties", "body", "_raw", "_state")  # fmt: skip


def _same(lean: Any, plain: Any) -> None:
    for name in FIELDS:
        assert getattr(lean, name) == getattr(plain, name), name
    assert [e[0] for e in lean.errors] == [e[0] for e in plain.errors]


class _Channel:
    """What kombu's message asks of its channel while it is built."""

    def decode_body(self, body: Any, encoding: str | None) -> Any:
        return Base64().decode(body) if encoding == "base64" else body


def _payload(body: Any = None, **changes: Any) -> dict[str, Any]:
    tid = str(uuid.uuid4())
    env = {"v": 1, "modality": "text", "priority": "bulk", "submitted_ms": 1.7e12,
           "deadline_ms": None, "inputs": {"text": "héllo"}}  # fmt: skip
    if body is None:
        body = orjson.dumps([[], {"request": env}, {"callbacks": None, "chain": None}])
    payload = {
        "body": base64.b64encode(body).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"lang": "py", "task": "fleet.text", "id": tid, "retries": 0},
        "properties": {
            "correlation_id": tid,
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": "text"},
            "priority": 3,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    payload.update(changes)
    return payload


def _both(payload: dict[str, Any]) -> tuple[Any, Any]:
    use_fast_json()
    ch = _Channel()
    lean, plain = Message(payload, channel=ch), KombuMessage(payload, channel=ch)
    for m in (lean, plain):
        m.accept = {"application/json"}  # as kombu's consumer sets it
    return lean, plain


def test_a_json_message_is_the_one_kombu_builds_its_body_decoded_once() -> None:
    lean, plain = _both(_payload())
    _same(lean, plain)
    assert lean.errors == []
    assert lean._decoded_cache is not None  # decoded while built: kombu's cache, filled
    assert lean.payload == plain.payload
    assert lean.payload[1]["request"]["inputs"] == {"text": "héllo"}


@pytest.mark.parametrize(
    "changes",
    [
        {"content-type": "application/x-other"},
        {"content-encoding": "binary"},
        {"headers": {"task": "fleet.text", "id": "a", "compression": "application/x-gzip"}},
    ],
)
def test_other_messages_are_built_by_kombu(changes: dict[str, Any]) -> None:
    lean, plain = _both(_payload(**changes))
    _same(lean, plain)
    assert lean._decoded_cache is None  # nothing decoded ahead: kombu decodes (or refuses)


def test_a_body_that_is_not_json_fails_where_kombus_does() -> None:
    lean, plain = _both(_payload(body=b"[1, 2"))
    assert lean._decoded_cache is None
    with pytest.raises(Exception) as kombu_error:
        plain.decode()
    with pytest.raises(type(kombu_error.value)):
        lean.decode()


def test_a_body_that_is_not_base64_fails_where_kombus_does() -> None:
    payload = _payload()
    payload["body"] = "not base64!"
    with pytest.raises(Exception) as kombu_error:
        KombuMessage(payload, channel=_Channel())
    with pytest.raises(type(kombu_error.value)):
        Message(payload, channel=_Channel())
