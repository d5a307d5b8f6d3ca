"""Several models of one modality on a stack of this module's own (real Redis, real Celery
workers, real torch): MiniLM (the text default) and a tiny BERT folder saved with
``save_pretrained`` (``tests/models/hf_tiny.py``) in two versions (CLS and mean pooling).

Workers: ``text`` serves MiniLM and both BERT versions (one worker, three models); ``text-1``
serves the BERT (version 1) alone and ``text-2`` MiniLM alone (two workers, one per model);
a fourth is started with a set that does not fit its memory partition and refuses to start.
The module first lets ``text`` alone consume (the others' consumers cancelled), then the
two single-model workers alone. Each request's embedding is compared with the model's own
in-process output. A model table no worker serves (``nobody``) is NO_READY_WORKER; a name
no table answers to is MODEL_NOT_FOUND at the client, the CLI (exit 2) and the gateway (404).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from producer.client import FleetClient, SubmitRequest
from producer.stack.procs import StackError
from shared.errors import ModelNotFound
from tests.conftest import free_port_block, ops_app
from tests.models.hf_tiny import build

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
TEXTS = ["a cat sat on the mat", "the big red car", "a photo of a dog in the sky", "coffee"]
BUDGET = 16 * 2**20 * 2  # text's max_batch_bytes per lane, two lanes (the REALTIME lane on)


@dataclass
class Fleet:
    stack: Any
    client: FleetClient
    refusal: str  # the StackError of the worker whose set does not fit
    refs: dict[str, Any]  # table -> its adapter, loaded in this process

    def node(self, instance: int) -> str:
        return f"{'text-' + str(instance) if instance else 'text'}@{socket.gethostname()}"

    def consume(self, instance: int, queues: list[str], on: bool) -> None:
        control = ops_app(self.client.settings).control
        for q in queues:
            if on:
                control.add_consumer(q, reply=True, destination=[self.node(instance)])
            else:
                control.cancel_consumer(q, reply=True, destination=[self.node(instance)])

    def reference(self, table: str, texts: list[str]) -> np.ndarray:
        a = self.refs[table]
        out = a.run_batch([a.preprocess(a.prepare({"text": t})) for t in texts])
        return np.asarray([r["embedding"] for r in out])


def _env(root: Path) -> dict[str, str]:
    folder = str(build(root, "bert"))
    bert = {"KIND": "hf-text", "CHECKPOINT": folder}
    tables = {
        "tiny-bert": {**bert, "POOLING": "cls"},
        "tiny-bert-2": {**bert, "POOLING": "mean", "SERVED_NAME": "tiny-bert", "VERSION": "2"},
        "nobody": {**bert, "POOLING": "last"},
    }
    env = {
        f"FLEET_MODELS__{name.upper()}__{k}": v
        for name, keys in tables.items()
        for k, v in keys.items()
    }
    env["FLEET_MODALITIES__TEXT__MODELS"] = json.dumps(list(tables))
    env["FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE"] = "4"  # short warmups
    env["FLEET_TENANTS__ACME__WEIGHT"] = "2"  # a tenant with lists of its own (fair share)
    return env


def _references(settings: Any) -> dict[str, Any]:
    from shared.settings import DeviceConfig
    from workers.models import make_adapter
    from workers.models.runtime import DeviceRuntime

    rt = DeviceRuntime(DeviceConfig())
    rt.start()
    refs = {}
    for table in ("minilm", "tiny-bert", "tiny-bert-2"):
        refs[table] = make_adapter("text", settings, rt, table)
        refs[table].load()
    return refs


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from producer.stack.local import Stack, isolated_environment
    from workers.models.hf_partition import host_memory_bytes
    from workers.models.model_set import adapter_bytes

    root = tmp_path_factory.mktemp("models")
    shm_root = Path(f"/dev/shm/mmfleet-models-{os.getuid()}-{secrets.token_hex(4)}")
    overrides = {
        "FLEET_CONFIG": str(REPO / "configs" / "fleet.toml"),
        "FLEET_TRANSPORT__SHM_ROOT": str(shm_root),
        # served: one test scrapes the three-model worker (replica ports: 4 per instance)
        "FLEET_METRICS__PORT_BASE": str(free_port_block(16)),
        **_env(root),
    }
    with isolated_environment(tmp_path_factory.mktemp("models-run"), overrides) as settings:
        refs = _references(settings)
        tiny, minilm = adapter_bytes(refs["tiny-bert"]), adapter_bytes(refs["minilm"])
        assert minilm > 80 * 2**20  # all-MiniLM-L6-v2: 22.7 M parameters in fp32
        # the BERT and the budget fit; MiniLM beside them does not (half of it would)
        fraction = (tiny + BUDGET + minilm // 2) / host_memory_bytes()
        st = Stack(settings)
        st.up([], flower=False, gateway=False)  # Redis
        try:
            workers = {
                0: {"FLEET_WORKER_MODELS": "minilm,tiny-bert,tiny-bert-2"},
                1: {"FLEET_WORKER_MODELS": "tiny-bert"},
                2: {"FLEET_WORKER_MODELS": "minilm"},
            }
            too_big = {
                "FLEET_WORKER_MODELS": "tiny-bert,minilm",
                "FLEET_MODALITIES__TEXT__DEVICE__MEMORY_FRACTION": repr(fraction),
            }
            with ThreadPoolExecutor(4) as pool:
                serving = [
                    pool.submit(st.start_worker, "text", "batch", i, env)
                    for i, env in workers.items()
                ]
                refusing = pool.submit(st.start_worker, "text", "batch", 3, too_big)
                for f in serving:
                    f.result()
                with pytest.raises(StackError) as err:
                    refusing.result()
            st.start_gateway()
            fleet = Fleet(st, FleetClient(settings), str(err.value), refs)
            fleet.consume(1, ["text@tiny-bert"], on=False)  # text alone consumes first
            fleet.consume(2, ["text"], on=False)
            time.sleep(1.2)  # a BRPOP issued before the cancel times out after 1 s
            yield fleet
            fleet.client.close()
        finally:
            st.down()
            shutil.rmtree(shm_root, ignore_errors=True)


def _close(got: list[list[float]], want: np.ndarray, what: str = "") -> None:
    got_a = np.asarray(got)
    cos = (got_a * want).sum(1) / (np.linalg.norm(got_a, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() > 0.999, (what, cos)
    np.testing.assert_allclose(got_a, want, atol=1e-4, err_msg=what)


def _round(fleet: Fleet) -> None:
    """Requests of both models interleaved in one submission: each result is its model's."""
    client = fleet.client
    # "tiny-bert" alone would be its latest version, 2 (tiny-bert-2): version 1 is named
    named = ((None, None), ("tiny-bert", "1"), ("minilm", None))
    reqs = [SubmitRequest("text", {"text": t}, model=m, version=v) for t in TEXTS for m, v in named]
    got = [h.get(60) for h in client.submit_many(reqs)]
    by_model: dict[str, list[Any]] = {"minilm": [], "tiny-bert": []}
    for r, req in zip(got, reqs, strict=True):
        by_model[req.model or "minilm"].append(r)
    for table, results in by_model.items():
        assert {r["dim"] for r in results} == {384 if table == "minilm" else 32}
        texts = [t for t in TEXTS for _ in range(2 if table == "minilm" else 1)]
        _close([r["embedding"] for r in results], fleet.reference(table, texts), table)


def test_one_worker_serves_two_models_each_request_from_its_own(fleet: Fleet) -> None:
    assert fleet.client.live_workers("text", "tiny-bert") == sorted([fleet.node(0), fleet.node(1)])
    assert fleet.client.live_workers("text", "tiny-bert-2") == [fleet.node(0)]
    argv = [sys.executable, "-m", "producer.cli", "status"]
    out = subprocess.run(argv, env=fleet.stack.env(), capture_output=True, text=True, timeout=60)
    models = json.loads(out.stdout)["live_models"]["text"]  # exit 3: the refused worker is down
    assert models["tiny-bert"] == sorted([fleet.node(0), fleet.node(1)])
    assert models["minilm"] == sorted([fleet.node(0), fleet.node(2)])
    assert (models["tiny-bert-2"], models["nobody"]) == ([fleet.node(0)], [])
    _round(fleet)


def _scrape(fleet: Fleet, instance: int) -> dict[str, float]:
    """Worker ``instance``'s ``/metrics``: each sample line's series -> value."""
    from producer.stack.ports import replica_metrics_port

    s = fleet.client.settings
    port = replica_metrics_port(s.metrics.port_base, "text", instance)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    rows = (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return {k: float(v) for k, v in rows}


def test_a_worker_of_two_models_counts_requests_and_batches_by_model(fleet: Fleet) -> None:
    def series(model: str) -> tuple[str, str]:
        labels = f'modality="text",model="{model}"'
        ok = f'fleet_requests_total{{{labels},outcome="ok",priority="normal"}}'
        return ok, f"fleet_batch_size_sum{{{labels}}}"

    before = _scrape(fleet, 0)
    reqs = [SubmitRequest("text", {"text": t}, model="tiny-bert", version="1") for t in TEXTS]
    reqs += [SubmitRequest("text", {"text": t}) for t in TEXTS[:3]]  # the default, minilm
    assert all(h.get(60) for h in fleet.client.submit_many(reqs))
    after = _scrape(fleet, 0)  # text (node 0) alone consumes both models' queues now
    for model, n in (("tiny-bert", 4), ("minilm", 3)):
        ok, batched = series(model)
        assert after[ok] - before.get(ok, 0.0) == n, (model, ok)
        assert after[batched] - before.get(batched, 0.0) == n, (model, batched)
    assert series("tiny-bert-2")[0] in after  # its counters exist at 0, never requested here


def test_the_exporter_reports_demand_and_consumers_per_model(fleet: Fleet) -> None:
    from prometheus_client import generate_latest

    from producer.ops.exporter import build_registry

    text = generate_latest(build_registry(fleet.client.settings)).decode()
    assert 'fleet_queue_demand{model="tiny-bert-2",queue="text@tiny-bert-2"} 0.0' in text
    assert 'fleet_queue_demand{model="minilm",queue="text"} 0.0' in text
    assert 'fleet_queue_consumers{model="tiny-bert",queue="text@tiny-bert"} 2.0' in text
    assert 'fleet_queue_consumers{model="nobody",queue="text@nobody.realtime"} 0.0' in text


def test_the_asyncio_client_names_a_model_and_a_version(fleet: Fleet) -> None:
    import asyncio

    from producer.client import AsyncFleetClient

    async def run() -> list[Any]:
        async with AsyncFleetClient(fleet.client.settings) as client:
            one = await client.submit("text", {"text": TEXTS[1]}, model="tiny-bert", version="2")
            many = await client.submit_many(
                [SubmitRequest("text", {"text": TEXTS[1]}, model="tiny-bert", version="1")]
            )
            return [await h.result(60) for h in (one, *many)]

    v2, v1 = asyncio.run(run())
    _close([v2["embedding"]], fleet.reference("tiny-bert-2", TEXTS[1:2]), "v2")
    _close([v1["embedding"]], fleet.reference("tiny-bert", TEXTS[1:2]), "v1")


def test_a_tenant_naming_a_model_waits_in_that_models_tenant_list(fleet: Fleet) -> None:
    """Models and tenants compose: a ``[tenants]`` tenant's request for a named model is
    pushed to the tenant list of that model's queue, taken from there by the worker serving
    the model, and answered by that model; through the gateway (header) too."""
    from shared.tenants import tenant_list_key

    client = fleet.client
    env = client.envelope("text", {"text": TEXTS[2]}, "bulk", None, "tiny-bert", "1")
    key = client.message(env.model_copy(update={"tenant": "acme"}), "probe").key
    assert key == tenant_list_key("text@tiny-bert", 9, "acme")
    h = client.submit("text", {"text": TEXTS[2]}, "bulk", model="tiny-bert", version="1",
                      tenant="acme")  # fmt: skip
    _close([h.get(60)["embedding"]], fleet.reference("tiny-bert", TEXTS[2:3]), "acme v1")
    s = client.settings
    auth = {"Authorization": f"Bearer {s.gateway_token()}", "X-Fleet-Tenant": "acme"}
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [TEXTS[3]]}]}
    with httpx.Client(base_url=fleet.stack.gateway_url(), headers=auth, timeout=60) as http:
        r = http.post("/v2/models/tiny-bert/versions/2/infer", json=body)
    assert r.status_code == 200, r.text
    _close([r.json()["outputs"][0]["data"]], fleet.reference("tiny-bert-2", TEXTS[3:4]))
    with client.app.connection_for_write() as conn:
        redis = conn.default_channel.client
        assert redis.llen(key) == 0  # taken from the tenant list, nothing left behind


def test_versions_side_by_side_through_the_gateway(fleet: Fleet) -> None:
    s = fleet.client.settings
    auth = {"Authorization": f"Bearer {s.gateway_token()}"}
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [TEXTS[0]]}]}
    with httpx.Client(base_url=fleet.stack.gateway_url(), headers=auth, timeout=60) as h:
        meta = h.get("/v2/models/tiny-bert").json()
        assert meta["name"] == "tiny-bert" and meta["versions"] == ["2", "1"]
        got = {}
        for path, table in (
            ("/v2/models/tiny-bert/versions/1/infer", "tiny-bert"),
            ("/v2/models/tiny-bert/versions/2/infer", "tiny-bert-2"),
            ("/v2/models/tiny-bert/infer", "tiny-bert-2"),  # no version: the latest
        ):
            r = h.post(path, json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["model_version"] == fleet.client.settings.models[table].version
            got[path] = out["outputs"][0]["data"]
            _close([got[path]], fleet.reference(table, TEXTS[:1]))
        assert not np.allclose(
            got["/v2/models/tiny-bert/versions/1/infer"], got["/v2/models/tiny-bert/infer"]
        )
        r = h.post("/v2/models/minilm/infer", json=body)  # the default model, as before
        _close([r.json()["outputs"][0]["data"]], fleet.reference("minilm", TEXTS[:1]))
        for path in ("/v2/models/nope/infer", "/v2/models/tiny-bert/versions/3/infer"):
            r = h.post(path, json=body)
            assert (r.status_code, r.json()["code"]) == (404, "MODEL_NOT_FOUND")
        r = h.post("/v2/models/nobody/infer", json=body)  # known, no worker serves it
        assert (r.status_code, r.json()["code"]) == (503, "NO_READY_WORKER")


def _cli(fleet: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "producer.cli", "submit", "text", "--text", "a cat", *args]
    return subprocess.run(argv, env=fleet.stack.env(), capture_output=True, text=True, timeout=120)


def test_unknown_model_and_a_model_nobody_serves_are_refused(fleet: Fleet) -> None:
    with pytest.raises(ModelNotFound, match="unknown model 'nope'"):
        fleet.client.submit("text", {"text": "a cat"}, model="nope")
    with pytest.raises(ModelNotFound, match="no version '7'"):
        fleet.client.submit("text", {"text": "a cat"}, model="tiny-bert", version="7")
    out = _cli(fleet, "--model", "nope")
    assert out.returncode == 2 and json.loads(out.stdout)["error"]["code"] == "MODEL_NOT_FOUND"
    out = _cli(fleet, "--model", "nobody")
    assert out.returncode == 3 and json.loads(out.stdout)["error"]["code"] == "NO_READY_WORKER"
    assert "--models nobody" in out.stderr
    queued = fleet.client.submit("text", {"text": "a cat"}, "bulk", model="nobody")  # no check
    argv = [sys.executable, "-m", "producer.cli", "result", queued.id]
    out = subprocess.run(argv, env=fleet.stack.env(), capture_output=True, text=True, timeout=60)
    where = json.loads(out.stdout)
    assert (where["where"], where["queue"], where["position"]) == ("queued", "text@nobody", 1)
    out = _cli(fleet, "--model", "tiny-bert", "--model-version", "1")
    assert out.returncode == 0, out.stderr
    _close([json.loads(out.stdout)["result"]["embedding"]], fleet.reference("tiny-bert", ["a cat"]))


def test_a_set_that_does_not_fit_the_partition_refuses_to_start(fleet: Fleet) -> None:
    err = fleet.refusal
    assert "engine failed to start: [MODEL_TOO_LARGE] models tiny-bert, minilm do not fit" in err
    assert "serve them on separate workers" in err
    assert not fleet.stack.alive(fleet.stack.worker_name("text", 3))


def test_two_workers_one_model_each(fleet: Fleet) -> None:
    """Last: the one-worker phase ends here."""
    fleet.consume(0, ["text", "text@tiny-bert"], on=False)
    fleet.consume(1, ["text@tiny-bert"], on=True)
    fleet.consume(2, ["text"], on=True)
    time.sleep(1.2)
    _round(fleet)
