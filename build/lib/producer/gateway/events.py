"""``GET /v2/jobs/{id}/events``: a job's progress and final state as Server-Sent Events.

Events: ``state`` once (``{"id", "state", "progress"}``), ``progress`` on every change of a
video's done/total frames (polled every ``[gateway] sse_interval_s``: workers store PROGRESS
without publishing it), ``final`` last (the job as ``GET /v2/jobs/{id}`` shows it), or
``timeout`` after ``max_wait_s``. A comment line every 15 s keeps proxies from closing an idle
stream. The final state arrives over the result waiter's pubsub, not by polling.
"""

from __future__ import annotations

import asyncio
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
    waiter = asyncio.ensure_future(jobs.waiter.wait(job.id, gw.max_wait_s))
    last = snap.progress
    quiet_since = time.monotonic()
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=gw.sse_interval_s)
            if done:
                meta = waiter.result()
                if meta is None:
                    yield sse("timeout", {"id": job.id, "state": "PENDING"})
                    return
                yield sse("final", await view(Snapshot(job, meta)))
                return
            if await request.is_disconnected():
                return
            cur = (await jobs.snapshot(job.id)) or snap
            if cur.progress is not None and cur.progress != last:
                last = cur.progress
                quiet_since = time.monotonic()
                yield sse("progress", {"id": job.id, "state": cur.state, **cur.progress})
            elif time.monotonic() - quiet_since > KEEPALIVE_S:
                quiet_since = time.monotonic()
                yield b": keep-alive\n\n"
    finally:
        waiter.cancel()
