"""Debug-only pauses at named points of the gateway's create path, for crash tests.

A test proves the create path crash-safe by SIGKILLing a real gateway process at each point
where it could die between two effects (``producer.gateway.jobs``, ``JobService.submit``).
A kill lands at a chosen point only if the process waits there, so a gateway started with
``FLEET_DEBUG_PAUSE_AT=<point>[,<point>...]`` logs ``debug pause at <point> (job <id>)``
and sleeps ``FLEET_DEBUG_PAUSE_S`` (60) seconds each time it gets there. The points, in
the order a job meets them:

- ``inputs-written``: its /dev/shm inputs (video) are written; Redis holds nothing of it;
- ``before-push``: the last moment before its record and its message go to Redis;
- ``after-push``: its record and message are on Redis; no answer was sent.

Not a setting (no ``fleet.toml`` key, no ``FLEET_<SECTION>__`` name): an operator never
sets it, and unset it costs one set lookup per point.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

__all__ = ["POINTS", "pause", "pause_sync"]

log = logging.getLogger("fleet.gateway")

POINTS = ("inputs-written", "before-push", "after-push")
_AT = frozenset(p.strip() for p in os.environ.get("FLEET_DEBUG_PAUSE_AT", "").split(",") if p)
_SECONDS = float(os.environ.get("FLEET_DEBUG_PAUSE_S", "60"))


def _announce(point: str, job_id: str) -> bool:
    if point not in _AT:
        return False
    log.warning("debug pause at %s (job %s) for %.0f s", point, job_id, _SECONDS)
    for h in logging.getLogger().handlers:  # the test reads the log while this one waits
        h.flush()
    return True


async def pause(point: str, job_id: str) -> None:
    """Wait at ``point`` when ``FLEET_DEBUG_PAUSE_AT`` names it (on the event loop)."""
    if _AT and _announce(point, job_id):
        await asyncio.sleep(_SECONDS)


def pause_sync(point: str, job_id: str) -> None:
    """As :func:`pause`, on a worker thread (the Sentinel path's commit)."""
    if _AT and _announce(point, job_id):
        time.sleep(_SECONDS)
