"""The SSE stream's logic (``producer.gateway.events.job_events``) over a job whose result
channel is given as a scripted sequence of documents: no servers (the stream against a real
gateway and worker is tests/integration/test_gateway.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from producer.gateway.events import job_events
from producer.gateway.jobs import Job, Snapshot
from shared.settings import GatewaySettings


class Watch:
    """What ``JobService.watch`` yields: the stored document, then published ones."""

    def __init__(self, stored: dict[str, Any] | None, published: list[dict[str, Any] | None]):
        self._stored, self._published = stored, list(published)

    async def stored(self, _timeout_s: float) -> dict[str, Any] | None:
        return self._stored

    async def published(self, timeout_s: float) -> dict[str, Any] | None:
        if self._published:
            return self._published.pop(0)
        await asyncio.sleep(timeout_s)  # nothing more is published
        return None


class Jobs:
    def __init__(self, watch: Watch) -> None:
        self._watch = watch

    @contextlib.asynccontextmanager
    async def watch(self, _task_id: str) -> AsyncIterator[Watch]:
        yield self._watch


class Connected:
    async def is_disconnected(self) -> bool:
        return False


async def _view(snap: Snapshot) -> dict[str, Any]:
    return {"id": snap.job.id, "state": snap.state}


def _events(watch: Watch, max_wait_s: float) -> list[tuple[str, dict[str, Any]]]:
    job = Job("j1", "minilm", "text", "normal", 0.0, None)
    gw = GatewaySettings(max_wait_s=max_wait_s, sse_interval_s=0.01)

    async def collect() -> list[bytes]:
        stream = job_events(Jobs(watch), Snapshot(job, None), Connected(), gw, _view)  # type: ignore[arg-type]
        return [chunk async for chunk in stream]

    out = []
    for chunk in asyncio.run(collect()):
        lines = chunk.decode().splitlines()
        if lines and lines[0].startswith("event: "):
            out.append((lines[0][7:], json.loads(lines[1][6:])))
    return out


def progress(done: int, total: int) -> dict[str, Any]:
    return {"status": "PROGRESS", "result": {"done": done, "total": total}}


def test_a_stream_that_times_out_in_progress_says_progress_and_where_it_was() -> None:
    events = _events(Watch(None, [progress(3, 10)]), max_wait_s=0.2)
    assert [e for e, _ in events] == ["state", "progress", "timeout"]
    assert events[-1][1] == {"id": "j1", "state": "PROGRESS", "progress": {"done": 3, "total": 10}}


def test_a_stream_that_times_out_queued_says_pending() -> None:
    events = _events(Watch(None, []), max_wait_s=0.1)
    assert events[-1] == ("timeout", {"id": "j1", "state": "PENDING", "progress": None})


def test_a_final_document_ends_the_stream_with_its_view() -> None:
    events = _events(Watch(None, [progress(1, 2), {"status": "SUCCESS", "result": {}}]), 5.0)
    assert events == [
        ("state", {"id": "j1", "state": "PENDING", "progress": None}),
        ("progress", {"id": "j1", "state": "PROGRESS", "done": 1, "total": 2}),
        ("final", {"id": "j1", "state": "SUCCESS"}),
    ]
