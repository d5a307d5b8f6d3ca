"""producer.client.wire's pure parts, without Redis: uuid4s made from random bytes, delivery tags,
the JSON formats a message is filled into, and the Lamport clock values reserved for a
chunk's ``task-sent`` events."""

from __future__ import annotations

import json
import os
import threading
import uuid

import pytest
from kombu.clocks import LamportClock

from producer.client.wire import _Format, _reserve, _uuid4s, fresh_ids


def test_uuid4s_are_what_uuid_makes_of_the_same_bytes() -> None:
    for _ in range(2000):
        raw = os.urandom(16)
        assert _uuid4s(raw) == [str(uuid.UUID(bytes=raw, version=4))]
    raw = os.urandom(16 * 5)
    want = [str(uuid.UUID(bytes=raw[i : i + 16], version=4)) for i in range(0, 80, 16)]
    assert _uuid4s(raw) == want


def test_fresh_ids_are_distinct_version_4_uuids() -> None:
    ids = fresh_ids(5000)
    assert len(set(ids)) == 5000
    assert all(uuid.UUID(i).version == 4 and str(uuid.UUID(i)) == i for i in ids)
    assert fresh_ids(0) == []


class _App:
    clock = LamportClock()


def test_delivery_tags_are_unique_uuid4_strings_across_builders_and_threads() -> None:
    from producer.client.wire import PayloadBuilder

    builders = [PayloadBuilder(_App()), PayloadBuilder(_App())]  # type: ignore[arg-type]
    got: list[bytes] = []

    def take(b: PayloadBuilder) -> None:
        for _ in range(50):
            got.extend(b._delivery_tags(100))

    threads = [threading.Thread(target=take, args=(b,)) for b in builders for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 * 50 * 100 == len(set(got))
    tags = [json.loads(t) for t in got]
    assert all(uuid.UUID(t).version == 4 and str(uuid.UUID(t)) == t for t in tags)


def test_a_format_takes_its_values_in_its_order_whatever_order_the_text_has() -> None:
    text = json.dumps({"b": "@@second@@", "pct": "100%", "a": "@@first@@", "b2": "@@second@@"})
    fmt = _Format(text, ("first", "second"))
    out = json.loads(fmt.fill((b'"one"', b"[2, 3]")))
    assert out == {"b": [2, 3], "pct": "100%", "a": "one", "b2": [2, 3]}


def test_a_format_with_extra_members_puts_them_last_in_their_object() -> None:
    text = json.dumps({"h": {"id": "@@id@@", "@@extra@@": 0}, "tag": "@@tag@@"})
    fmt = _Format(text, ("id", "extra", "tag"))
    assert json.loads(fmt.fill((b'"x"', b', "trace": "t"', b'"y"'))) == {
        "h": {"id": "x", "trace": "t"},
        "tag": "y",
    }
    assert json.loads(fmt.fill((b'"x"', b"", b'"y"'))) == {"h": {"id": "x"}, "tag": "y"}


def test_a_format_refuses_unknown_markers_and_fewer_than_two() -> None:
    with pytest.raises(ValueError):
        _Format(json.dumps({"a": "@@a@@", "b": "@@b@@"}), ("a",))
    with pytest.raises(ValueError):
        _Format(json.dumps({"a": "@@a@@"}), ("a",))


def test_reserved_clock_values_are_what_forward_would_give() -> None:
    clock, other = LamportClock(), LamportClock()
    for c in (clock, other):
        c.forward()
        c.forward()
    first = _reserve(clock, 5)
    assert list(range(first, first + 5)) == [other.forward() for _ in range(5)]
    assert clock.forward() == other.forward()  # both moved on by the same amount
