"""``GET /v2/jobs/{id}/events``: a job's progress and final state as Server-Sent Events.

Events: ``state`` once (``{"id", "state", "progress"}``), ``progress`` on every change of a
video's done/total frames, ``final`` last (the job as ``GET /v2/jobs/{id}`` shows it), or
``timeout`` after ``max_wait_s`` (``{"id", "state", "progress"}``: ``PENDING``, or ``PROGRESS``
with the last progress seen). Documents arrive as the worker publishes them, on the job's
result channel (``JobService.watch``, ``producer.gateway.waiter``: subscribed, confirmed,
the stored document read once, then what is published; nothing polls). Between documents
the stream checks every ``[gateway] sse_interval_s`` whether its client is gone, and sends a
comment line after 15 s of quiet so that proxies do not close an idle stream.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from producer.gateway.jobs import JobService, Snapshot
from shared.settings import GatewaySettings

KEEPALIVE_S = 15.0


def sse(event: str, data: Any) -> bytes:
    """One Server-Sent Event (``event:`` and one ``data:`` line of JSON)."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def job_events(
    jobs: JobService,
    snap: Snapshot,
    request: Any,
    gw: GatewaySettings,
    view: Callable[[Snapshot], Awaitable[dict[str, Any]]],
) -> AsyncIterator[bytes]:
    """The event stream of one job (ends at its final state or a client disconnect)."""
    job = snap.job
    yield sse("state", {"id": job.id, "state": snap.state, "progress": snap.progress})
    if snap.final:
        yield sse("final", await view(snap))
        return
    last = snap.progress
    quiet_since = time.monotonic()
    end = quiet_since + gw.max_wait_s
    async with jobs.watch(job.id) as watch:
        meta = await watch.stored(gw.max_wait_s)
        while True:
            cur = None if meta is None else Snapshot(job, meta)
            if cur is not None and cur.final:
                yield sse("final", await view(cur))
                return
            if cur is not None and cur.progress is not None and cur.progress != last:
                last = cur.progress
                quiet_since = time.monotonic()
                yield sse("progress", {"id": job.id, "state": cur.state, **cur.progress})
            elif time.monotonic() - quiet_since > KEEPALIVE_S:
                quiet_since = time.monotonic()
                yield b": keep-alive\n\n"
            left = end - time.monotonic()
            if left <= 0:
                state = "PENDING" if last is None else "PROGRESS"
                yield sse("timeout", {"id": job.id, "state": state, "progress": last})
                return
            if await request.is_disconnected():
                return
            meta = await watch.published(min(gw.sse_interval_s, left))
