"""OpenTelemetry traces across producer, queue, batch and model, on a real stack.

The producer (this process) records into the SDK's ``InMemorySpanExporter``; the text worker
(its own stack, ``[tracing] file`` set) writes its spans to a file, read back here. A request
from ``FleetClient`` must make one trace: ``fleet.submit`` -> ``fleet.request`` ->
``fleet.batch`` (linked to every member's request span) -> ``model.forward`` and
``result.write``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from producer.client import FleetClient, SubmitRequest
from shared import tracing
from tests.conftest import own_text_stack

pytestmark = pytest.mark.integration


def _hex(n: int, width: int) -> str:
    return f"0x{n:0{width}x}"


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans_file = tmp_path_factory.mktemp("spans") / "worker-spans.jsonl"
    overrides = {
        "FLEET_TRACING__FILE": str(spans_file),
        "FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE": "4",
    }
    with own_text_stack(tmp_path_factory, "tracing", overrides) as st:
        memory = InMemorySpanExporter()
        tracing.reset()
        tracing.configure(st.s, "fleet-producer", exporter=memory)
        client = FleetClient(st.s)
        try:
            yield {"client": client, "memory": memory, "file": spans_file}
        finally:
            client.close()
            tracing.reset()


def _worker_spans(path: Path, trace_ids: set[str], names: set[str], timeout_s: float = 20) -> Any:
    """The worker's spans of ``trace_ids`` once every name of ``names`` is among them."""
    deadline = time.monotonic() + timeout_s
    spans: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        if path.exists():
            spans = [json.loads(line) for line in path.read_text().splitlines() if line]
            spans = [s for s in spans if s["context"]["trace_id"] in trace_ids]
            if names <= {s["name"] for s in spans}:
                return spans
        time.sleep(0.2)
    raise AssertionError(f"worker spans of {names} not written: got {spans}")


def test_one_request_is_one_trace_from_producer_to_model(traced: dict[str, Any]) -> None:
    client, memory = traced["client"], traced["memory"]
    handle = client.submit("text", {"text": "Follow me through the fleet."}, "high")
    assert handle.get(30)["dim"] == 384
    submits = [s for s in memory.get_finished_spans()
               if s.attributes.get("messaging.message.id") == handle.id]  # fmt: skip
    assert [s.name for s in submits] == ["fleet.submit"]
    producer = submits[0]
    trace_id = _hex(producer.context.trace_id, 32)
    want = {"fleet.request", "fleet.batch", "model.forward", "result.write"}
    spans = _worker_spans(traced["file"], {trace_id}, want)
    by_name = {s["name"]: s for s in spans}
    request, batch = by_name["fleet.request"], by_name["fleet.batch"]
    assert request["parent_id"] == _hex(producer.context.span_id, 16)
    assert request["kind"] == "SpanKind.CONSUMER"
    assert request["attributes"]["messaging.message.id"] == handle.id
    assert request["attributes"]["fleet.outcome"] == "ok"
    assert batch["parent_id"] == request["context"]["span_id"]
    assert request["context"]["span_id"] in {ln["context"]["span_id"] for ln in batch["links"]}
    for child in ("model.forward", "result.write"):
        assert by_name[child]["parent_id"] == batch["context"]["span_id"], child


def test_a_batch_links_every_member(traced: dict[str, Any]) -> None:
    client, memory = traced["client"], traced["memory"]
    memory.clear()
    handles = client.submit_many(
        SubmitRequest("text", {"text": f"member {i}"}, "normal") for i in range(4)
    )
    outs = client.wait_all(handles, timeout_s=60)
    assert all(o and "result" in o for o in outs), outs
    submits = {s.attributes["messaging.message.id"]: s for s in memory.get_finished_spans()}
    assert set(submits) == {h.id for h in handles}
    traces = {_hex(s.context.trace_id, 32) for s in submits.values()}
    assert len(traces) == 4  # one trace per request
    spans = _worker_spans(traced["file"], traces, {"fleet.request", "fleet.batch"})
    requests = {s["attributes"]["messaging.message.id"]: s for s in spans
                if s["name"] == "fleet.request"}  # fmt: skip
    requests = _until_all(traced["file"], traces, requests, set(submits))
    linked = {
        ln["context"]["span_id"]
        for s in _worker_spans(traced["file"], traces, {"fleet.batch"})
        if s["name"] == "fleet.batch"
        for ln in s["links"]
    }
    for task_id, span in requests.items():
        assert span["context"]["span_id"] in linked, task_id
        assert span["parent_id"] == _hex(submits[task_id].context.span_id, 16)


def _until_all(path: Path, traces: set[str], got: dict[str, Any], ids: set[str]) -> dict[str, Any]:
    deadline = time.monotonic() + 20
    while set(got) != ids and time.monotonic() < deadline:
        time.sleep(0.2)
        spans = _worker_spans(path, traces, {"fleet.request"})
        got = {s["attributes"]["messaging.message.id"]: s for s in spans
               if s["name"] == "fleet.request"}  # fmt: skip
    assert set(got) == ids
    return got
