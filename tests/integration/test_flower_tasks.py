"""Flower's task list against the session stack (real Redis, text and image workers, the
Flower ``fleet up`` starts): the fleet's columns, and each request's result summary in the
``result`` column (its batch size, or a failure's error code) from the workers' events."""

from __future__ import annotations

import ast
import base64
import json
import re
import time
from typing import Any
from urllib.parse import urlencode
from urllib.request import Request, urlopen

import pytest

from producer.client import FleetClient
from shared.errors import FleetError

pytestmark = pytest.mark.integration


def flower(stack: Any, path: str) -> str:
    s = stack.s
    token = base64.b64encode(f"{s.flower.user}:{s.flower_password()}".encode()).decode()
    req = Request(f"{stack.flower_url()}{path}", headers={"Authorization": f"Basic {token}"})
    with urlopen(req, timeout=5) as r:
        return r.read().decode()


def datatable_rows(stack: Any) -> dict[str, dict[str, Any]]:
    """The rows the tasks page draws (its ``/tasks/datatable`` call), newest first."""
    query = {
        "draw": 1,
        "start": 0,
        "length": 1000,
        "order[0][column]": 0,
        "order[0][dir]": "desc",
        "columns[0][data]": "received",
    }
    body = json.loads(flower(stack, f"/tasks/datatable?{urlencode(query)}"))
    return {row["uuid"]: row for row in body["data"]}


def test_the_task_list_shows_the_fleets_columns_result_among_them(stack: Any) -> None:
    page = flower(stack, "/tasks")
    shown = re.findall(r'<th data-column="([a-z_]+)"', page)
    # producer/ops/flower_app.py's TASKS_COLUMNS (importing it would load a stack's settings)
    assert shown == ["name", "uuid", "state", "result", "received", "started", "runtime", "worker"]


def test_a_finished_requests_row_carries_its_summary(stack: Any, client: FleetClient) -> None:
    """Successes show their batch (size, id, timings), a worker's refusal its error code;
    never the result itself (an embedding's 384 numbers)."""
    ok = [client.submit("text", {"text": f"flower column {i}"}) for i in range(3)]
    bad = client.submit("text", {"text": "   "})
    for h in ok:
        assert len(h.get(60)["embedding"]) == 384
    with pytest.raises(FleetError) as err:
        bad.get(60)
    assert err.value.code == "INVALID_INPUT"
    ids = {h.id for h in [*ok, bad]}
    deadline = time.monotonic() + 30  # events reach Flower a flush interval after the result
    tasks: dict[str, Any] = {}
    while time.monotonic() < deadline:
        tasks = json.loads(flower(stack, "/api/tasks?limit=1000"))
        if all(tasks.get(i, {}).get("state") in ("SUCCESS", "FAILURE") for i in ids):
            break
        time.sleep(0.25)
    for h in ok:
        task = tasks[h.id]
        assert task["state"] == "SUCCESS", task
        summary = ast.literal_eval(task["result"])
        assert isinstance(summary["batch_size"], int) and 1 <= summary["batch_size"] <= 16
        assert set(summary) == {"batch_id", "batch_size", "queued_ms", "run_ms"}
        assert len(task["result"]) < 200  # a summary, not the embedding
    failed = tasks[bad.id]
    assert failed["state"] == "FAILURE", failed
    assert ast.literal_eval(failed["result"])["error"] == "INVALID_INPUT"
    # the page's rows: the same summaries, under the result column
    rows = datatable_rows(stack)
    assert rows[bad.id]["result"] == failed["result"]
    assert all(rows[h.id]["result"] == tasks[h.id]["result"] for h in ok)
