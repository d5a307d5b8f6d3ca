"""The bench's peer modes without the peers: skip reasons, ratios, the HTTP sender.

The peers themselves run in ``tests/integration/test_bench_peers.py`` (where ``make peers``
was run); here: what decides whether a peer mode runs, how its figures enter the report,
and how the Ray sender turns a real HTTP server's answers into outcomes.
"""

from __future__ import annotations

import http.server
import io
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from rich.console import Console

from producer.tools.bench.peers import PEER_MODES, unavailable_reason
from producer.tools.bench.peers.report import print_peers
from producer.tools.bench.peers.sender import RaySender
from producer.tools.bench.records import SEND_FAILED, RecordTable, Timebase
from producer.tools.bench.report import _ratios
from producer.tools.bench.schedule import Planned


@pytest.mark.parametrize("mode", PEER_MODES)
def test_a_missing_peer_venv_is_a_reason_naming_the_fix(mode: str, monkeypatch: Any) -> None:
    monkeypatch.setenv("FLEET_BENCH_PEERS_PYTHON", "/nonexistent/bin/python")
    reason = unavailable_reason(mode)
    assert reason is not None
    assert reason.startswith(f"{mode}: no peer venv at /nonexistent/bin/python")
    assert "make peers" in reason


def test_a_peer_venv_without_the_peer_is_a_reason(monkeypatch: Any) -> None:
    import sys

    # This venv (the fleet's) has neither celery_batches nor ray: the import probe says so.
    monkeypatch.setenv("FLEET_BENCH_PEERS_PYTHON", sys.executable)
    for mode, module in (("celery-batches", "celery_batches"), ("ray-serve", "ray")):
        try:
            __import__(module)
        except ImportError:
            reason = unavailable_reason(mode)
            assert reason is not None and f"cannot import {module}" in reason
        else:  # pragma: no cover - someone installed the peer into the fleet's venv
            assert unavailable_reason(mode) is None


def _mode(rps: float) -> dict[str, Any]:
    return {"throughput_rps": rps, "throughput_spread": {"min": rps, "median": rps, "max": rps}}


def test_ratios_name_each_peer_that_ran() -> None:
    modes = {
        "fleet": {"text": _mode(150.0)},
        "baseline": {"text": _mode(50.0)},
        "limit": {"text": _mode(200.0)},
        "celery-batches": {"text": _mode(60.0)},
        "ray-serve": {"text": _mode(40.0)},
    }
    r = _ratios(modes)["text"]
    assert r["fleet_over_baseline"] == pytest.approx(3.0)
    assert r["fleet_over_limit"] == pytest.approx(0.75)
    assert r["fleet_over_celery-batches"] == pytest.approx(2.5)
    assert r["fleet_over_ray-serve"] == pytest.approx(3.75)
    del modes["ray-serve"]
    assert "fleet_over_ray-serve" not in _ratios(modes)["text"]


def test_peers_table_shows_each_peer_and_the_ratio() -> None:
    report = {
        "modes": {"fleet": {"text": _mode(150.0)}, "ray-serve": {"text": _mode(40.0)}},
        "ratios": {"text": {"fleet_over_ray-serve": 3.75}},
    }
    buf = io.StringIO()
    print_peers(report, Console(file=buf, width=200))
    out = buf.getvalue()
    assert "ray-serve" in out and "celery-batches" not in out
    assert "40.0 (40.0-40.0)" in out and "3.75" in out
    buf = io.StringIO()
    print_peers({"modes": {"fleet": {"text": _mode(1.0)}}, "ratios": {}}, Console(file=buf))
    assert buf.getvalue() == ""  # no peer ran: no table


class _Answers(http.server.BaseHTTPRequestHandler):
    """Answers /infer as the Ray peer does, by the text it is sent."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = body["request"]["inputs"]["text"]
        if text == "boom":
            status, out = 500, b"Internal Server Error"
        elif text == "bad":
            status, out = 200, json.dumps({"error": {"code": "INVALID_INPUT"}}).encode()
        else:
            status, out = 200, json.dumps({"result": {"echo": text}}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def peer_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class _Catalog:
    def get(self, source: str, index: int) -> dict[str, Any]:
        return {"text": source}


def test_ray_sender_completes_records_from_the_answers(peer_url: str) -> None:
    from producer.client import FleetClient
    from shared.settings import load_settings

    table = RecordTable()
    client = FleetClient(load_settings(redis={"password": "x"}))  # envelopes only: no Redis
    try:
        sender = RaySender(
            client, _Catalog(), table, Timebase(), 0, urls={"text": peer_url}, connections=2
        )
        items = [
            (Planned("p", 0.0, src, "text", i, "bulk", None, True), 0.0)
            for i, src in enumerate(["hello", "bad", "boom", "there"])
        ]
        recs = sender.send(items, producer=None)
        sender.close()
    finally:
        client.app.close()
    by_text = {r.source: r for r in table.records()}
    assert len(recs) == 4 and table.done == 4
    assert by_text["hello"].ok and by_text["there"].ok
    assert (by_text["bad"].ok, by_text["bad"].code) == (False, "INVALID_INPUT")
    assert (by_text["boom"].ok, by_text["boom"].code) == (False, "HTTP_500")
    assert SEND_FAILED not in {r.code for r in table.records()}
