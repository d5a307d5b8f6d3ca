"""shared.schema: documents equal in value to kombu's JSON, kombu's codec where orjson's
rules differ (no servers)."""

from __future__ import annotations

import datetime as dt
import json
import math
import uuid

import numpy as np
import orjson
import pytest
from celery import Celery
from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads

from shared import schema
from shared.errors import ImageDecodeError, error_to_wire


def _meta(result: object, status: str = "SUCCESS") -> dict[str, object]:
    return {
        "status": status,
        "result": result,
        "traceback": None,
        "children": [],
        "date_done": "2026-12-02T16:00:00.123456+00:00",
        "task_id": str(uuid.uuid4()),
    }


def _embedding(seed: int, dim: int = 384) -> list[float]:
    return np.random.default_rng(seed).standard_normal(dim).astype(np.float32).tolist()


DOCS = [
    _meta({"embedding": _embedding(0), "dim": 384, "tokens": 12, "truncated": False}),
    _meta({"scores": [0.5, -1e-300, 1e300, 5e-324], "labels": ["a", "é", "\u2028"]}),
    _meta(error_to_wire(ImageDecodeError("not an image")), status="FAILURE"),
    _meta({"done": 3, "total": 9}, status="PROGRESS"),
    _meta({"big": 2**63 - 1, "neg": -(2**63), "nested": [[1, 2.0], {"k": None}]}),
]


@pytest.mark.parametrize("doc", DOCS)
def test_encoded_documents_read_back_as_kombus_own(doc: dict[str, object]) -> None:
    text = schema.dumps(doc)
    assert json.loads(text) == json.loads(kombu_dumps(doc)) == doc
    assert schema.loads(text.encode()) == doc
    assert schema.loads(kombu_dumps(doc)) == doc


def test_float_reprs_are_pythons_shortest_round_trip() -> None:
    emb = _embedding(1)
    text = schema.dumps(emb)
    # every float reads back to the same float64 bits (and so to the same float32)
    back = json.loads(text)
    assert all(a == b for a, b in zip(back, emb, strict=True))
    assert np.array_equal(np.asarray(back, np.float32), np.asarray(emb, np.float32))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_keep_kombus_tokens(bad: float) -> None:
    doc = _meta({"embedding": [0.5, bad, 1.0]})
    text = schema.dumps(doc)
    assert text == kombu_dumps(doc)  # NaN / Infinity, never orjson's null
    assert "null, 1.0" not in text
    back = schema.loads(text)["result"]["embedding"]
    assert back[0] == 0.5 and (math.isnan(back[1]) if math.isnan(bad) else back[1] == bad)


@pytest.mark.parametrize(
    "doc",
    [
        {"traceback": None, "result": math.nan},  # its null beside the document's own
        {"a": None, "b": None, "c": [None, -math.inf]},
        {"a": None, "b": {"c": None, "d": math.nan}},
        [None, math.inf],
        (math.nan,),
        math.nan,
    ],
)
def test_non_finite_floats_beside_nones_keep_kombus_tokens(doc: object) -> None:
    assert schema.dumps(doc) == kombu_dumps(doc)


@pytest.mark.parametrize(
    "doc",
    [
        {"traceback": None, "result": {"text": "null and void", "x": 0.5}},
        {"a": None, "b": [None, 1.5, "null"]},
        None,
        [None, None],
    ],
)
def test_nulls_without_a_non_finite_float_are_orjsons(doc: object) -> None:
    text = schema.dumps(doc)
    assert json.loads(text) == json.loads(kombu_dumps(doc))
    assert text == orjson.dumps(doc).decode()


def test_types_json_lacks_are_left_to_kombu() -> None:
    when = dt.datetime(2026, 12, 2, 16, 0, tzinfo=dt.UTC)
    doc = {"when": when, "n": 2**70, 3: "int key"}
    assert schema.dumps(doc) == kombu_dumps(doc)
    # kombu's type tags are read by kombu
    assert schema.loads(kombu_dumps({"when": when}))["when"] == when
    with pytest.raises(TypeError):
        schema.dumps({"x": object()})


def test_numpy_scalars_are_encoded_as_kombu_encodes_them() -> None:
    doc = {"f64": np.float64(0.1), "list": [np.float64(1.5), 2.0]}
    assert json.loads(schema.dumps(doc)) == json.loads(kombu_dumps(doc))


def test_not_json_raises_value_error() -> None:
    for raw in (b"not json", b"\xff\xfe", b'{"a": '):
        with pytest.raises(ValueError):
            schema.loads(raw)


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        ([1.0, 2.0], False),
        ([1e308, 1e308], False),  # the sum overflows; every element is finite
        ([1.0, math.nan], True),
        ({"a": {"b": [0.0, [math.inf]]}}, True),
        ([1, "x", 2.0], False),
        ((0.5, -math.inf), True),
        ("nan", False),
        ([], False),
    ],
)
def test_has_nonfinite(obj: object, expected: bool) -> None:
    assert schema.has_nonfinite(obj) is expected


def test_decode_result_matches_celerys_backend() -> None:
    app = Celery("t", broker="redis://127.0.0.1:1/0", backend="redis://127.0.0.1:1/0")
    app.conf.result_serializer = "json"
    backend = app.backend  # builds no connection until a command runs
    for doc in DOCS:
        raw = schema.dumps(doc).encode()
        ours, celerys = schema.decode_result(backend, raw), backend.decode_result(raw)
        if doc["status"] == "FAILURE":  # exceptions compare by identity: compare their parts
            assert isinstance(ours["result"], ImageDecodeError)
            assert ours.pop("result").args == celerys.pop("result").args
        assert ours == celerys
    assert kombu_loads(schema.dumps(DOCS[0])) == DOCS[0]


def test_events_are_json_of_the_same_content_type_read_back_as_kombus_own() -> None:
    """Task events (``EVENT_SERIALIZER``): the ``application/json`` content type and reader
    of ``json``, so Flower and any Celery event receiver decode them; ``json`` keeps naming
    the content type."""
    from kombu.serialization import dumps as k_dumps
    from kombu.serialization import registry

    from shared.celery_app import EVENT_SERIALIZER, use_fast_json

    use_fast_json()
    now = 1765000000.123456
    events = [
        {"hostname": "text@h", "utcoffset": 0, "pid": 7, "clock": 12, "uuid": str(uuid.uuid4()),
         "result": "{'batch_id': 'h-1-2', 'run_ms': 0.5}", "runtime": 0.0005,
         "timestamp": now, "type": "task-succeeded"},
        {"uuid": "x", "root_id": "x", "parent_id": None, "args": "()", "eta": None,
         "kwargs": "{'request': {'text': 'é'}}", "timestamp": now, "type": "task-received"},
    ]  # fmt: skip
    ctype, encoding, data = k_dumps(events, serializer=EVENT_SERIALIZER)
    assert (ctype, encoding) == ("application/json", "utf-8")
    assert kombu_loads(data) == kombu_loads(kombu_dumps(events)) == events
    assert registry.type_to_name["application/json"] == "json"
    stamped = {"eta": dt.datetime(2026, 12, 7, tzinfo=dt.UTC)}  # orjson leaves it to kombu
    assert kombu_loads(schema.dumps_event(stamped)) == kombu_loads(kombu_dumps(stamped))
