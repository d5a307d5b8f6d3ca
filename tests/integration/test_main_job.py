"""The main job end to end: real Redis, real text/image workers, real models, Flower."""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.request import Request, urlopen

import pytest

from producer.client import FleetClient, SubmitRequest, image_inputs, outcome_from_meta
from shared.errors import FleetError, QueueFull
from tests.conftest import ops_app

pytestmark = pytest.mark.integration
DATA = Path(__file__).resolve().parents[2] / "data"


def cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def fleet_stats(client: FleetClient, node_prefix: str) -> dict[str, Any]:
    replies = ops_app(client.settings).control.broadcast("fleet_stats", reply=True, timeout=2.0)
    for r in replies:
        for node, stats in r.items():
            if node.startswith(node_prefix):
                return stats
    raise AssertionError(f"no fleet_stats reply from {node_prefix}: {replies}")


def test_cli_text_embedding_is_unit_norm_and_semantic(client: FleetClient) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "producer.cli", "submit", "text",
         "--text", "A man is playing a guitar.", "--priority", "realtime",
         "--timeout-s", "30"],  # a loaded CI machine must not turn this into a timing test
        capture_output=True, text=True, timeout=60, env=dict(os.environ),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    emb = json.loads(proc.stdout)["result"]["embedding"]
    assert len(emb) == 384
    assert math.isclose(math.sqrt(sum(x * x for x in emb)), 1.0, abs_tol=1e-4)
    related = client.submit("text", {"text": "Someone is playing an instrument."}).get(30)
    unrelated = client.submit("text", {"text": "The stock market fell sharply today."}).get(30)
    assert cos(emb, related["embedding"]) > cos(emb, unrelated["embedding"]) + 0.3


def test_cli_bad_input_exits_nonzero_with_code(stack: object) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "producer.cli", "submit", "text", "--text", "   "],
        capture_output=True, text=True, timeout=60, env=dict(os.environ),
    )  # fmt: skip
    assert proc.returncode == 2
    assert json.loads(proc.stdout)["error"]["code"] == "INVALID_INPUT"


@pytest.mark.parametrize(
    ("inputs", "code"),
    [
        ({"text": ""}, "INVALID_INPUT"),
        ({"text": "\x01\x02\u200b"}, "INVALID_INPUT"),
        ({"text": "x " * 15000}, "PAYLOAD_TOO_LARGE"),
        ({"txt": "hello"}, "INVALID_INPUT"),
        ({"text": 42}, "INVALID_INPUT"),
    ],
)
def test_bad_text_fails_with_code_and_worker_keeps_serving(
    client: FleetClient, inputs: dict[str, Any], code: str
) -> None:
    with pytest.raises(FleetError) as err:
        client.submit("text", inputs).get(30)
    assert err.value.code == code
    assert client.submit("text", {"text": "Still serving."}).get(30)["dim"] == 384


def test_bad_images_fail_alone_inside_a_batch(client: FleetClient) -> None:
    good = ["skimage_coffee.png", "pillow_hopper.jpg", "pillow_flower.webp"]
    bad = {
        "pillow_truncated_jpeg.jpg": "IMAGE_DECODE",
        "pillow_broken.png": "IMAGE_DECODE",
        "pillow_decompression_bomb.gif": "PAYLOAD_TOO_LARGE",
    }
    reqs = [SubmitRequest("image", image_inputs(DATA / "images" / g)) for g in good]
    reqs += [SubmitRequest("image", image_inputs(DATA / "images" / "bad" / b)) for b in bad]
    outs = client.wait_all(client.submit_many(reqs), timeout_s=60)
    for o in outs[: len(good)]:
        assert o is not None and "result" in o, o
        emb = o["result"]["embedding"]
        assert len(emb) == 1280
        assert math.isclose(math.sqrt(sum(x * x for x in emb)), 1.0, abs_tol=1e-4)
    assert [o["error"]["code"] for o in outs[len(good) :]] == list(bad.values())


def test_deadline_passed_is_not_run(client: FleetClient) -> None:
    with pytest.raises(FleetError) as err:
        client.submit("text", {"text": "Too late."}, timeout_s=0.0005).get(30)
    assert err.value.code == "DEADLINE_EXCEEDED"


def test_batches_form_under_load_and_match_single_results(client: FleetClient) -> None:
    lines = (DATA / "text" / "botchan_sentences.txt").read_text().splitlines()
    texts = [t for t in lines if 30 < len(t) < 90][:64]
    before = fleet_stats(client, "text@")
    handles = client.submit_many([SubmitRequest("text", {"text": t}, "bulk") for t in texts])
    outs = client.wait_all(handles, timeout_s=120)
    assert all(o is not None and "result" in o for o in outs)
    after = fleet_stats(client, "text@")
    new_sizes = {
        int(k): v - before["batch_sizes"].get(k, 0) for k, v in after["batch_sizes"].items()
    }
    assert max(k for k, v in new_sizes.items() if v > 0) > 1, new_sizes
    # The batch's acks shared pipelines, and every message is acked: kombu's unacked hash
    # and index (what a restart would redeliver) hold nothing once the results are in.
    with ops_app(client.settings).connection_for_write() as conn:
        redis = conn.default_channel.client
        deadline = time.monotonic() + 10
        while redis.hlen("unacked") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert redis.hlen("unacked") == 0 and redis.zcard("unacked_index") == 0
    acked = fleet_stats(client, "text@")["acked_in_batches"] - before["acked_in_batches"]
    assert acked >= 2, acked
    alone = client.submit("text", {"text": texts[5]}, "realtime").get(30)["embedding"]
    batched = outs[5]["result"]["embedding"]  # type: ignore[index]
    assert max(abs(a - b) for a, b in zip(alone, batched, strict=True)) < 1e-4


def test_pickled_message_is_refused_coded_and_never_runs(client: FleetClient) -> None:
    from kombu import Queue

    task_id = str(uuid.uuid4())
    body = (
        (),
        {"request": {"modality": "text", "priority": "normal", "inputs": {"text": "pickled"}}},
        {},
    )
    # Raw bytes with the pickle content type, as an attacker or a misconfigured producer
    # would push them: the worker must refuse to deserialize them.
    raw = pickle.dumps(body)
    with client.app.connection_for_write() as conn:
        conn.Producer().publish(
            raw, exchange="text", routing_key="text",
            content_type="application/x-python-serialize", content_encoding="binary",
            headers={"task": "fleet.text", "id": task_id, "lang": "py"},
            priority=6, declare=[Queue("text")],
        )  # fmt: skip
    # A request queued behind it at the same priority: once it is done, the pickle was seen.
    assert client.submit("text", {"text": "After the pickle."}).get(30)["dim"] == 384
    # Never deserialized, never run: its sender gets a coded failure instead of silence.
    meta = client.app.backend.get_task_meta(task_id)
    assert meta["status"] == "FAILURE"
    assert outcome_from_meta(meta)["error"]["code"] == "INVALID_MESSAGE"
    assert "ContentDisallowed" in outcome_from_meta(meta)["error"]["message"]
    assert sum(client.queue_depth("text").values()) == 0  # consumed and acked


def test_queue_full_refuses_then_everything_drains(
    client: FleetClient, fleet_settings: Any
) -> None:
    from shared.settings import load_settings

    limit = 5
    limited = FleetClient(
        load_settings(
            modalities={
                "text": {
                    **fleet_settings.modalities["text"].model_dump(),
                    "max_queue_length": limit,
                }
            }
        )
    )
    ops_app(client.settings).control.cancel_consumer(
        "text", reply=True, destination=_text_nodes(client)
    )
    try:
        handles = [limited.submit("text", {"text": f"queued {i}"}) for i in range(limit)]
        with pytest.raises(QueueFull) as err:
            limited.submit("text", {"text": "one too many"})
        assert err.value.code == "QUEUE_FULL"
    finally:
        ops_app(client.settings).control.add_consumer(
            "text", reply=True, destination=_text_nodes(client)
        )
    outs = limited.wait_all(handles, timeout_s=60)
    assert all(o is not None and "result" in o for o in outs)


def _text_nodes(client: FleetClient) -> list[str]:
    return [
        n
        for r in ops_app(client.settings).control.ping(timeout=1.0)
        for n in r
        if n.startswith("text@")
    ]


def test_flower_shows_each_request_with_its_batch(client: FleetClient, stack: Any) -> None:
    handle = client.submit("text", {"text": "Visible in Flower."})
    handle.get(30)
    s = stack.s
    token = base64.b64encode(f"{s.flower.user}:{s.flower_password()}".encode()).decode()
    url = f"{stack.flower_url()}/api/task/info/{handle.id}"
    info: dict[str, Any] = {}
    for _ in range(50):  # events reach Flower asynchronously
        try:
            with urlopen(Request(url, headers={"Authorization": f"Basic {token}"}), timeout=2) as r:
                info = json.loads(r.read())
            if info.get("state") == "SUCCESS":
                break
        except Exception:
            pass
        time.sleep(0.1)
    assert info.get("state") == "SUCCESS", info
    assert "batch_id" in str(info.get("result")), info
    # the producer's task-sent event (grouped, producer.client.wire.sent_group) reached Flower too
    assert info.get("sent") and info["sent"] <= info["received"], info
    with pytest.raises(Exception, match="401"):
        urlopen(f"{stack.flower_url()}/api/tasks", timeout=2)


def test_worker_serves_prometheus_metrics(client: FleetClient, fleet_settings: Any) -> None:
    from shared.metrics import metrics_port

    client.submit("text", {"text": "Counted in Prometheus."}).get(30)
    port = metrics_port(fleet_settings, "text")
    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    ok = [
        line for line in text.splitlines()
        if line.startswith("fleet_requests_total{") and 'outcome="ok"' in line
    ]  # fmt: skip
    assert ok and sum(float(line.rsplit(" ", 1)[1]) for line in ok) >= 1
    assert 'fleet_batch_size_count{modality="text",model="minilm"}' in text
    assert 'fleet_prefetch_held{modality="text"}' in text


def test_raw_envelopes_a_worker_refuses_keep_metrics_bounded(
    client: FleetClient, fleet_settings: Any
) -> None:
    # What a producer in another language can send past FleetClient's own checks.
    from shared.metrics import metrics_port

    def raw(request: dict[str, Any], args: tuple[Any, ...] = ()) -> Any:
        return client.app.send_task("fleet.text", args=args, kwargs={"request": request},
                                    queue="text", priority=6)  # fmt: skip

    base = {"v": 1, "modality": "text", "priority": "normal", "inputs": {"text": "Raw."}}
    bogus = "prio-" + "x" * 300
    cases = {
        "INVALID_PRIORITY": raw({**base, "priority": bogus}),
        "MODEL_NOT_FOUND": raw({**base, "model": "not-a-served-model"}),  # an InvalidInput
        "INVALID_INPUT ": raw(base, args=(1, 2)),  # positional args
    }
    served = raw({**base, "model": fleet_settings.modalities["text"].model})
    for code, res in cases.items():
        res.get(timeout=30, propagate=False)
        assert res.result.args[1] == code.strip(), (code, res.result)
    assert served.get(timeout=30)["dim"] == 384
    port = metrics_port(fleet_settings, "text")
    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    # Every bounded label set is served from the start (at 0): the refusal must count.
    refused = [
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
        if line.startswith("fleet_requests_total{") and 'outcome="INVALID_PRIORITY"' in line
    ]  # fmt: skip
    assert sum(refused) >= 1 and bogus not in text


def test_realtime_overtakes_a_full_prefetch_window_of_bulk(client: FleetClient) -> None:
    lines = (DATA / "text" / "botchan_sentences.txt").read_text().splitlines()
    backlog = [SubmitRequest("text", {"text": t}, "bulk") for t in lines if t.strip()][:600]
    bulk = client.submit_many(backlog)
    assert sum(client.queue_depth("text").values()) > 0  # a backlog is waiting
    rt = client.submit("text", {"text": "Urgent."}, "realtime", timeout_s=30)
    assert rt.envelope.priority == "realtime"
    rt_done = client.wait_all([rt], timeout_s=60)[0]
    bulk_done = client.wait_all(bulk, timeout_s=120)
    assert rt_done is not None and "result" in rt_done
    # REALTIME travels on its own queue and channel: it does not wait for the BULK backlog
    # (600 requests, several seconds of work) ahead of it, nor for the window it fills.
    finished_before = sum(1 for o in bulk_done if o and o["done_ms"] <= rt_done["done_ms"])
    assert finished_before < len(bulk) // 2, finished_before


def test_a_ready_worker_has_frozen_its_startup_heap(client: FleetClient) -> None:
    """The model, torch, the tokenizer and Celery are out of the collector's full passes
    (workers.batching.heap), so one does not walk them with the event loop held: a large frozen
    count, and the full collections since start each far shorter than walking that heap."""
    import gc

    stats = fleet_stats(client, "text@")["gc"]
    assert stats["frozen"] > 100_000, stats
    gens = stats["generations"]
    assert len(gens) == 3 and all(g["count"] >= 0 for g in gens)
    # This test process's own heap (pytest, torch imported, no model) walked once, for scale.
    t0 = time.perf_counter()
    gc.collect()
    walk_s = time.perf_counter() - t0
    if gens[2]["count"]:
        assert gens[2]["max_s"] < max(0.05, 2 * walk_s), (stats, walk_s)
