"""A real Prometheus scrapes ``fleet exporter`` and a text worker during a short load.

Every expression of ``configs/observability/rules.yml`` and of the Grafana dashboard is
evaluated through Prometheus' HTTP API and must return data; the alerts the load provokes
(failures, deadline misses, demand with no consumer, a worker target down, /dev/shm near
its budget) must fire. Queue demand must equal the submitted-but-unfinished requests while a
prefetching worker holds a full window (behind a slow batch) and a backlog waits in Redis at
three priorities: ``LLEN`` (``celery_queue_length``) is a window short of it.

Prometheus is Debian's package (``/usr/bin/prometheus``, installed by ``.ci/run``), run here
on a free loopback port with its own config and storage in a temporary directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import yaml

from producer.client import FleetClient, SubmitRequest
from producer.stack.local import free_port
from tests.conftest import free_port_block, own_text_stack

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
OBS = REPO / "configs" / "observability"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
WINDOW = 8  # the text worker's prefetch window here
SHM_BUDGET = 4 * 2**20  # the exporter's /dev/shm budget here: one tensor fills 95 % of it
# Alerts the load below provokes; FleetExporterCannotReadRedis only has its signal checked.
PROVOKED = {
    "FleetHighFailureRate",
    "FleetDeadlineMissRate",
    "FleetDemandGrowingNoConsumer",
    "FleetWorkerDown",
    "FleetShmNearCapacity",
}


def _need(binary: str) -> None:
    if not os.access(binary, os.X_OK):
        msg = f"{binary} missing: apt-get install -y prometheus (.ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


# -- the configs on their own -------------------------------------------------------------
def test_promtool_accepts_the_rules_and_both_configs(tmp_path: Path) -> None:
    _need(PROMTOOL)
    for args in (
        ["check", "rules", str(OBS / "rules.yml")],
        ["check", "config", str(OBS / "prometheus-local.yml")],
        # compose's names its rules by their path inside the container
        ["check", "config", "--syntax-only", str(OBS / "prometheus.yml")],
    ):
        out = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"promtool {' '.join(args)}:\n{out.stdout}{out.stderr}"


def test_the_dashboard_is_grafana_json_on_the_provisioned_datasource() -> None:
    dash = json.loads((OBS / "grafana" / "dashboards" / "fleet.json").read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ds = yaml.safe_load((OBS / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 13
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == uid and p["type"] in ("timeseries", "stat"), p["title"]
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]) and p["description"], p["title"]
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    mounts = " ".join(compose["grafana"]["volumes"])
    assert "configs/observability/grafana/dashboards" in mounts
    assert compose["prometheus"]["profiles"] == compose["grafana"]["profiles"] == ["observability"]


def dashboard_exprs() -> list[str]:
    dash = json.loads((OBS / "grafana" / "dashboards" / "fleet.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def rule_groups() -> list[dict[str, Any]]:
    return yaml.safe_load((OBS / "rules.yml").read_text())["groups"]


def alert_signal(expr: str) -> str:
    """An alert's expression without its final ``<op> <number>``: what it compares."""
    m = re.fullmatch(r"(.*\S)\s*(==|!=|>=|<=|>|<)\s*-?[\d.]+(e-?\d+)?\s*", expr.strip(), re.S)
    assert m, f"alert expression is not '<signal> <op> <threshold>': {expr!r}"
    return m.group(1)


# -- Prometheus ---------------------------------------------------------------------------
class Prom:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> Any:
        q = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{q}", timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.get("/api/v1/query", query=expr)["result"]

    def value(self, expr: str) -> float | None:
        res = self.query(expr)
        return float(res[0]["value"][1]) if res else None


@pytest.fixture(scope="module")
def obs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    _need(PROMETHEUS)
    shm_root = Path("/dev/shm") / f"mmfleet-obs-test-{uuid.uuid4().hex[:8]}"
    overrides = {
        "FLEET_METRICS__PORT_BASE": str(free_port_block(4)),
        "FLEET_METRICS__EXPORTER_PORT": str(free_port()),
        "FLEET_DEBUG__FAULT_INJECTION": "true",
        "FLEET_MODALITIES__TEXT__DEVICE__PREFETCH_MULTIPLIER": str(WINDOW),
        "FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE": "4",
        "FLEET_TRANSPORT__SHM_ROOT": str(shm_root),
        "FLEET_TRANSPORT__CAPACITY_BYTES": str(SHM_BUDGET),
        # a tenant with lists of its own and a max_queued: the tenants' panel has series
        "FLEET_TENANTS__ACME__MAX_QUEUED": "1000",
        "FLEET_TENANTS__ACME__WEIGHT": "2",
    }
    prom_proc = None
    try:
        with own_text_stack(tmp_path_factory, "obs", overrides) as st:
            s = st.s
            tmp = tmp_path_factory.mktemp("prometheus")
            # The rules as shipped, evaluated every second (the global interval) here.
            groups = [{k: v for k, v in g.items() if k != "interval"} for g in rule_groups()]
            (tmp / "rules.yml").write_text(yaml.safe_dump({"groups": groups}))
            image_port = s.metrics.port_base + 1  # the image worker's: not started
            config = {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(tmp / "rules.yml")],
                "scrape_configs": [
                    {
                        "job_name": "fleet-exporter",
                        "static_configs": [{"targets": [f"127.0.0.1:{s.metrics.exporter_port}"]}],
                    },
                    {
                        "job_name": "fleet-workers",
                        "static_configs": [
                            {
                                "targets": [
                                    f"127.0.0.1:{s.metrics.port_base}",
                                    f"127.0.0.1:{image_port}",
                                ]
                            }
                        ],
                    },
                ],
            }
            (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
            port = free_port()
            log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - handed to the child
            prom_proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={tmp / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            log.close()
            prom = Prom(f"http://127.0.0.1:{port}")
            _until(lambda: _ready(prom.url), 60, "prometheus ready", tmp / "prometheus.log")
            # Its discovery hands targets over every 5 s: wait until each was scraped once.
            _until(
                lambda: len(t := _targets(prom)) == 3 and all(h != "unknown" for _, h, _ in t),
                60, "every target scraped", tmp / "prometheus.log",
            )  # fmt: skip
            client = FleetClient(s)
            try:
                yield {"stack": st, "settings": s, "prom": prom, "client": client,
                       "shm_root": shm_root, "log": tmp / "prometheus.log"}  # fmt: skip
            finally:
                client.close()
                admin = redis.Redis.from_url(s.redis_url("admin"), socket_timeout=5)
                denied = admin.execute_command("ACL", "LOG", "20")
                assert denied == [], f"Redis refused the exporter or workers: {denied}"
    finally:
        if prom_proc is not None:
            prom_proc.terminate()
            try:
                prom_proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                prom_proc.kill()
                prom_proc.wait()
        shutil.rmtree(shm_root, ignore_errors=True)


def _targets(prom: Prom) -> list[tuple[str, str, str]]:
    """(scrape URL, health, last error) of every target: for failure messages."""
    active = prom.get("/api/v1/targets")["activeTargets"]
    return [(t["scrapeUrl"], t["health"], t["lastError"]) for t in active]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def _until(check: Callable[[], Any], timeout_s: float, what: str, log: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.25)
    tail = log.read_text()[-3000:] if log and log.exists() else ""
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s\n{tail}")


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_demand_counts_the_prefetch_window_llen_hides(obs: dict[str, Any]) -> None:
    s, client, prom = obs["settings"], obs["client"], obs["prom"]
    exporter = f"http://127.0.0.1:{s.metrics.exporter_port}/metrics"
    worker = f"http://127.0.0.1:{s.metrics.port_base}/metrics"
    # A batch that runs for a while: nothing finishes while the window fills behind it.
    slow = client.submit("text", {"text": "hold", "_inject": "slow:20"}, "high", timeout_s=120)
    _until(
        lambda: any(v == 1 for k, v in _scrape(worker).items()
                    if k.startswith("celery_worker_tasks_active")),
        30, "the slow batch running",
    )  # fmt: skip
    backlog = client.submit_many(
        SubmitRequest("text", {"text": f"waiting {i}"}, prio, 120)
        for prio in ("high", "normal", "bulk")
        for i in range(10)
    )
    handles = [slow, *backlog]
    reserved = 'fleet_queue_reserved{model="minilm",queue="text"}'  # exposition order
    _until(lambda: _scrape(exporter).get(reserved) == WINDOW, 30, "a full prefetch window")
    time.sleep(2.5)  # a few scrapes of the stable state
    unfinished = sum(o is None for o in client.poll(handles))
    demand = prom.value('fleet_queue_demand{queue="text"}')
    length = prom.value('celery_queue_length{queue_name="text"}')
    by_prio = {
        r["metric"]["priority"]: float(r["value"][1])
        for r in prom.query('fleet_queue_waiting{queue="text"} > 0')
    }
    assert unfinished == len(handles) == 31, "a request finished during the check"
    assert demand == unfinished, (demand, unfinished, _targets(prom))
    assert length == unfinished - WINDOW, (length, unfinished)  # LLEN: a window short
    assert prom.value('fleet_queue_reserved{queue="text"}') == WINDOW
    assert sum(by_prio.values()) == length and set(by_prio) >= {"normal", "bulk"}, by_prio
    # The oldest is the running request (reserved, not in any list); a sample is <= 1 s old.
    age = prom.value('fleet_queue_oldest_age_seconds{queue="text"}')
    true_age = time.time() - slow.envelope.submitted_ms / 1000.0
    assert age is not None and true_age - 1.5 <= age <= true_age, (age, true_age)
    client.wait_all(handles, timeout_s=120)


def test_every_dashboard_and_rule_expression_returns_data(obs: dict[str, Any]) -> None:
    client, prom = obs["client"], obs["prom"]
    from shared.transport import ShmStore

    # Near the exporter's /dev/shm budget: one tensor of 95 % of it, in the fleet's root.
    store = ShmStore(obs["shm_root"], SHM_BUDGET + 2**20, role="producer")
    ref = store.put(np.zeros(int(SHM_BUDGET * 0.95) // 4, dtype=np.float32), ttl_s=600)
    # Demand with no consumer: video requests, and no video worker.
    video = [client.submit("video", {"video": "nothing"}, "bulk", 600)]
    # A transient fault, alone in its batch (bisecting a batch would be its second attempt):
    # retried once, then a success.
    flaky = client.submit("text", {"text": "flaky", "_inject": "transient:1"}, "high", 60)
    assert flaky.get(30)["dim"] == 384
    handles = [flaky]
    # Deadline misses: short deadlines behind a slow batch.
    handles.append(client.submit("text", {"text": "x", "_inject": "slow:3"}, "high", 60))
    time.sleep(0.5)
    handles += client.submit_many(
        SubmitRequest("text", {"text": f"late {i}"}, "normal", 0.5) for i in range(10)
    )
    # Failures: inputs the text model refuses (INVALID_INPUT).
    handles += client.submit_many(
        SubmitRequest("text", {"bogus": i}, "normal", 60) for i in range(15)
    )
    # Successes at every class.
    handles += client.submit_many(
        SubmitRequest("text", {"text": f"fine {i}"}, prio, 60)
        for prio in ("realtime", "high", "normal", "bulk")
        for i in range(10)
    )
    time.sleep(2.0)
    video.append(client.submit("video", {"video": "nothing"}, "bulk", 600))
    outs = client.wait_all(handles, timeout_s=120)
    codes = [o.get("error", {}).get("code") if isinstance(o, dict) else None for o in outs]
    assert codes.count("DEADLINE_EXCEEDED") >= 5 and codes.count("INVALID_INPUT") == 15, codes
    try:
        exprs = [r["expr"] for g in rule_groups() for r in g["rules"] if "record" in r]
        exprs += [alert_signal(r["expr"]) for g in rule_groups() for r in g["rules"]
                  if "alert" in r]  # fmt: skip
        exprs += dashboard_exprs()
        alerts = {r["alert"]: r["expr"] for g in rule_groups() for r in g["rules"] if "alert" in r}
        assert set(alerts) >= PROVOKED
        exprs += [alerts[a] for a in sorted(PROVOKED)]  # these must fire
        empty: list[str] = exprs
        deadline = time.monotonic() + 60
        while empty and time.monotonic() < deadline:
            empty = [e for e in empty if not prom.query(e)]
            time.sleep(1.0)
        assert not empty, f"expressions without data: {empty}; targets {_targets(prom)}"
        firing = {
            a["labels"]["alertname"] for a in prom.get("/api/v1/alerts")["alerts"]
        }  # pending or firing: their `for` is minutes
        assert firing >= PROVOKED, firing
        # The Celery-named series of the worker carry the task, node and queue.
        got = prom.query("sum by (name, queue_name) (celery_task_succeeded_total) > 0")
        assert {(r["metric"]["name"], r["metric"]["queue_name"]) for r in got} >= {
            ("fleet.text", "text"),
            ("fleet.text", "text.realtime"),
        }
        assert prom.value("sum(celery_task_sent_total)") >= len(handles) + len(video)
        # The same failures under both names; the transient fault was retried once.
        invalid = 'sum(fleet_inference_request_failure_total{reason="INVALID_INPUT"})'
        assert prom.value(invalid) == 15
        failed = prom.value("sum(celery_task_failed_total)")
        assert failed == prom.value("sum(fleet_inference_request_failure_total)") >= 20
        assert prom.value("sum(celery_task_retried_total)") == 1
        assert prom.value("sum(celery_task_received_total)") >= len(handles) + 31
        batches = prom.value("sum(fleet_inference_exec_count_total)")
        runs = prom.value("sum(fleet_inference_count_total)")
        assert batches and runs and runs >= batches  # mean batch size >= 1
    finally:
        store.release(ref)
