"""Routing by model (``shared.model_routes``), the ModelSet's bucket logic and its memory
check: pure logic, no Redis, no torch model."""

from __future__ import annotations

from typing import Any

import pytest

from shared import model_routes, schema
from shared.errors import ModelNotFound
from shared.settings import load_settings
from workers.models.hf_partition import ModelTooLarge
from workers.models.model_set import ModelSet, check_set_fits

TINY = {"kind": "hf-text", "checkpoint": "/nowhere"}


def settings(**extra: Any) -> Any:
    models = {
        "bge-small": TINY,
        "bge-small-2": {**TINY, "served_name": "bge-small", "version": "2"},
        "bge-small-10": {**TINY, "served_name": "bge-small", "version": "10"},
        **extra,
    }
    return load_settings(
        models=models,
        modalities={"text": {"model": "minilm", "models": list(models)}},
    )


def test_no_name_is_the_default_and_a_name_without_version_its_latest() -> None:
    s = settings()
    assert model_routes.resolve(s, "text", None).table == "minilm"
    # numeric order, not text order: 10 is later than 2
    assert model_routes.resolve(s, "text", "bge-small").table == "bge-small-10"
    assert model_routes.resolve(s, "text", "bge-small", "2").table == "bge-small-2"
    assert model_routes.resolve(s, "text", "bge-small", "1").table == "bge-small"
    assert model_routes.resolve(s, "text", "bge-small-2").table == "bge-small-2"  # by table
    assert model_routes.resolve(s, "text", None, "1").table == "minilm"


def test_unknown_models_and_versions_are_model_not_found() -> None:
    s = settings()
    with pytest.raises(ModelNotFound, match="unknown model 'nope' for text; served: bge-small"):
        model_routes.resolve(s, "text", "nope")
    with pytest.raises(ModelNotFound, match=r"no version '3' \(versions: 10, 2, 1\)"):
        model_routes.resolve(s, "text", "bge-small", "3")
    with pytest.raises(ModelNotFound):
        model_routes.resolve(s, "image", "bge-small")  # another modality's model
    assert ModelNotFound("x").code == "MODEL_NOT_FOUND"


def test_the_default_keeps_the_modality_queues_and_others_get_their_own() -> None:
    s = settings()
    default, other = (
        model_routes.resolve(s, "text", None),
        model_routes.resolve(s, "text", "bge-small"),
    )
    assert (default.queue, default.realtime_queue) == ("text", "text.realtime")
    assert (other.queue, other.realtime_queue) == (
        "text@bge-small-10",
        "text@bge-small-10.realtime",
    )
    assert schema.queue_for("text", "bulk", other.route_model) == "text@bge-small-10"
    assert schema.queue_for("text", "realtime", None) == "text.realtime"
    assert schema.live_key("text", "bge-small") == "fleet:live:text@bge-small"
    assert schema.live_key("text") == "fleet:live:text"


def test_a_worker_serves_what_models_names_or_every_model() -> None:
    s = settings()
    everything = model_routes.worker_models(s, "text")
    assert [m.table for m in everything] == ["minilm", "bge-small", "bge-small-2", "bge-small-10"]
    picked = model_routes.worker_models(s, "text", "bge-small-2, minilm")
    assert [m.table for m in picked] == ["bge-small-2", "minilm"]
    main, rt = model_routes.worker_queues(picked, realtime_apart=True)
    assert main == ["text@bge-small-2", "text"]
    assert rt == ["text@bge-small-2.realtime", "text.realtime"]
    together = model_routes.worker_queues(picked, realtime_apart=False)
    assert together == (
        ["text@bge-small-2", "text@bge-small-2.realtime", "text", "text.realtime"],
        [],
    )
    with pytest.raises(ModelNotFound, match="--models names 'resnet18-random'"):
        model_routes.worker_models(s, "text", "resnet18-random")


def test_settings_refuse_an_unknown_table_and_a_duplicate_version() -> None:
    with pytest.raises(ValueError, match="models names 'ghost'"):
        load_settings(modalities={"text": {"model": "minilm", "models": ["ghost"]}})
    with pytest.raises(ValueError, match="both 'bge-small' version 1"):
        settings(twin={**TINY, "served_name": "bge-small"})
    with pytest.raises(ValueError, match="version"):
        load_settings(models={"x": {**TINY, "version": "v2"}})  # a number, as Triton's


def test_a_model_set_bucket_names_its_model() -> None:
    assert ModelSet.split("bge-small|len32") == ("bge-small", "len32")
    assert ModelSet.split("len32") == (None, "len32")
    assert ModelSet.split(None) == (None, None)


class _Runtime:
    device = type("D", (), {"type": "cpu", "index": None})()
    cfg = type("C", (), {"memory_fraction": 0.5})()


def test_a_set_that_does_not_fit_its_partition_is_refused_naming_every_size() -> None:
    mib = 2**20
    part = (100 * mib, "memory_fraction 0.5 of 200 MiB on the host (cpu)")
    assert check_set_fits({"a": 40 * mib}, 16 * mib, _Runtime(), part) == 56 * mib
    with pytest.raises(ModelTooLarge) as err:
        check_set_fits({"a": 40 * mib, "b": 50 * mib}, 16 * mib, _Runtime(), part)
    assert err.value.code == "MODEL_TOO_LARGE"
    assert "models a, b do not fit" in err.value.message
    assert "a 40.0 MiB, b 50.0 MiB" in err.value.message and "106.0 MiB" in err.value.message


def test_a_worker_of_several_models_labels_each_request_and_batch_with_its_model() -> None:
    from prometheus_client import generate_latest

    from shared.metrics import FleetMetrics

    queues = {"text": "minilm", "text.realtime": "minilm", "text@bge": "bge"}
    m = FleetMetrics("text", "minilm", "text@h", enabled=True, queue_models=queues)
    m.observe_requests([("bulk", "ok", 0.1, 0.2, "text@bge", 0.05)])
    m.observe_requests([("bulk", "ok", 0.1, 0.2, "text", 0.05)] * 2)
    m.observe_batch(3, 0.1, "bge")
    m.observe_batch(2, 0.1, None)  # no model named: the default
    text = generate_latest(m.registry).decode()
    assert 'fleet_inference_request_success_total{modality="text",model="bge"} 1.0' in text
    assert 'fleet_inference_request_success_total{modality="text",model="minilm"} 2.0' in text
    assert 'fleet_inference_count_total{modality="text",model="bge"} 3.0' in text
    assert 'fleet_inference_count_total{modality="text",model="minilm"} 2.0' in text
    assert 'queue_name="text@bge"' in text  # the model's queue is a label, not "other"
    # the worker's own series carry the model too
    ok = 'fleet_requests_total{{modality="text",model="{}",outcome="ok",priority="bulk"}} {}'
    assert ok.format("bge", "1.0") in text and ok.format("minilm", "2.0") in text
    assert 'fleet_batch_size_sum{modality="text",model="bge"} 3.0' in text
    assert 'fleet_batch_size_sum{modality="text",model="minilm"} 2.0' in text
    # every model's counters exist at 0 from the start (rate() of a first burst counts)
    idle = 'fleet_requests_total{modality="text",model="bge",outcome="DEADLINE_EXCEEDED"'
    assert idle + ',priority="high"} 0.0' in text


def test_fleet_worker_refuses_a_model_its_modality_does_not_serve() -> None:
    from typer.testing import CliRunner

    from producer.cli import app

    res = CliRunner().invoke(app, ["worker", "text", "--models", "minilm,resnet18-random"])
    assert res.exit_code == 2  # refused before anything starts
    assert "--models names 'resnet18-random'" in res.output


def _scaled(factor: int) -> Any:
    """A model that multiplies ``x`` by ``factor``, with the buckets ``short`` and ``long``."""
    from engine_fakes import Doubler

    from workers.models.base import Prepared

    class Scaled(Doubler):
        def prepare(self, inputs: dict[str, Any]) -> Prepared:
            bucket = "short" if inputs["x"] < 10 else "long"
            return Prepared(bucket=bucket, length=1, nbytes=8, payload=inputs["x"])

        def run_batch(self, samples: list[Any]) -> list[dict[str, Any]]:
            self.calls.append(list(samples))
            return [{"y": factor * s} for s in samples]

        def buckets(self) -> list[str]:
            return ["short", "long"]

    return Scaled()


def test_a_model_set_routes_each_request_and_never_mixes_models_in_a_batch() -> None:
    a, b = _scaled(2), _scaled(3)
    models = ModelSet({"a": a, "b": b}, default="a", runtime=_Runtime())  # type: ignore[arg-type]
    pa, pb, pd = (models.prepare_for(m, {"x": 4}) for m in ("a", "b", None))
    assert (pa.bucket, pb.bucket, pd.bucket) == ("a|short", "b|short", "a|short")
    assert models.prepare_for("b", {"x": 40}).bucket == "b|long"
    samples = [models.preprocess(p) for p in (pb, pb)]
    assert models.run_batch(samples) == [{"y": 12}, {"y": 12}]  # b's own output
    assert b.calls == [[4, 4]] and a.calls == []
    with pytest.raises(RuntimeError, match="mixes models"):
        models.run_batch([models.preprocess(pa), models.preprocess(pb)])
    with pytest.raises(ModelNotFound, match="not served by this worker"):
        models.prepare_for("c", {"x": 1})
    only_b = ModelSet({"b": b}, default=None, runtime=_Runtime())  # type: ignore[arg-type]
    with pytest.raises(ModelNotFound):
        only_b.prepare_for(None, {"x": 1})  # the default is not served here
    # warmup: the models take turns, each model's buckets in its own order
    assert models.buckets() == ["a|short", "b|short", "a|long", "b|long"]
    (example,) = models.example_inputs(1, "b|long")
    assert models.prepare(example).bucket == "b|short"  # made for b: prepared by b


def test_the_gateway_picks_a_version_latest_by_default_and_lists_them() -> None:
    from producer.gateway.models import model_specs, pick_spec

    specs = model_specs(settings())
    latest = pick_spec(specs, "bge-small")
    assert (latest.key, latest.version, latest.route_model) == ("bge-small-10", "10", latest.key)
    assert latest.metadata()["versions"] == ["10", "2", "1"]
    assert latest.metadata()["name"] == "bge-small"
    assert pick_spec(specs, "bge-small", "2").key == "bge-small-2"
    default = pick_spec(specs, "minilm")
    assert (default.default, default.route_model, default.live_model) == (True, None, None)
    with pytest.raises(ModelNotFound, match="unknown model 'bge-small' version '3'"):
        pick_spec(specs, "bge-small", "3")
    with pytest.raises(ModelNotFound, match=r"served: .*bge-small \(versions 10, 2, 1\)"):
        pick_spec(specs, "nope")
