"""The producer's routing table (``shared.model_routes.Routes``): every (modality, priority,
model) triple's queue and Celery priority, a table's queue-name part, resolved names kept.
Pure logic, no Redis."""

from __future__ import annotations

import pytest

from shared import model_routes, schema
from shared.errors import ModelNotFound
from shared.settings import MODALITIES, load_settings

TINY = {"kind": "hf-text", "checkpoint": "/nowhere"}


def two_text_models() -> model_routes.Routes:
    settings = load_settings(
        models={
            "bge-small": TINY,
            "bge-small-2": {**TINY, "served_name": "bge-small", "version": "2"},
        },
        modalities={"text": {"model": "minilm", "models": ["bge-small", "bge-small-2"]}},
    )
    return model_routes.Routes(settings)


def test_every_triple_has_its_queue_and_celery_priority() -> None:
    routes = two_text_models()
    s = routes.settings
    for p in schema.Priority:
        want = p.celery_priority(s)
        for modality in MODALITIES:  # the default model: the modality's own queues
            assert routes.queues[(modality, p.label, None)] == (
                schema.queue_for(modality, p.label, None),
                want,
            )
        # a non-default model: queues of its own (text@<table>, text@<table>.realtime)
        assert routes.queues[("text", p.label, "bge-small-2")] == (
            schema.queue_for("text", p.label, "bge-small-2"),
            want,
        )
    assert routes.queues[("text", "realtime", "bge-small")][0] == "text@bge-small.realtime"
    assert routes.queues[("text", "bulk", "bge-small")][0] == "text@bge-small"
    assert ("image", "bulk", "bge-small") not in routes.queues  # text's model only


def test_route_model_of_tables_and_the_default() -> None:
    routes = two_text_models()
    assert routes.route_model("text", "bge-small-2") == "bge-small-2"
    assert routes.route_model("text", "minilm") is None  # the default keeps "text"
    with pytest.raises(ModelNotFound):
        routes.route_model("text", "nope")


def test_served_resolves_names_and_versions_and_keeps_them() -> None:
    routes = two_text_models()
    assert routes.served("text").table == "minilm"
    assert routes.served("text", "bge-small").table == "bge-small-2"  # latest
    assert routes.served("text", "bge-small", "1").table == "bge-small"
    first = routes.served("text", "bge-small")
    assert routes.served("text", "bge-small") is first  # looked up, not resolved again
    with pytest.raises(ModelNotFound):
        routes.served("text", "bge-small", "3")
