"""A batching worker keeps time by Redis' clock, and says when its own clock is off.

Why: every timestamp a worker writes or compares with another host's is on Redis' clock
(``shared.clock``): its leases' scores (its renewals, its fetch script's, kombu's own
``QoS.append``), its restore scan's ceiling (kombu's ``restore_visible``: entries older than
"now" less the visibility timeout return to their queue), its liveness heartbeats, its
deadline checks and its latency figures. A worker whose wall clock runs an hour ahead would
otherwise take every live worker's lease for lapsed and run their messages again, and fail
every request with a deadline; one an hour behind would look dead.

:func:`start` makes the lease keeper's clock the process's (``shared.clock.install``), points
kombu's Redis transport at it (the transport reads the module-level ``time`` it imported
from :mod:`time` for exactly two things: the unacked index's scores and the restore scan's
ceiling), takes the first sample before the worker fetches anything, and reports every
sample: the gauge ``fleet_worker_clock_skew_seconds`` (this host's wall clock minus Redis')
and a warning when the skew passes ``[redis] clock_skew_warn_s``: when it crosses the bound,
when it changes by more than the bound, every ``REMIND_S`` while it lasts, and once more when
the worker is ready (:func:`remind`: the first sample is taken before Celery configures
logging, so that first line has no level or time); an info line once it is back within. The
lease keeper's thread takes the later samples (``shared.clock.RedisClock.now`` in each
renewal).

Private kombu/Celery names (read from kombu 5.7.0; ``tests/unit/test_private_names.py``):
    kombu.transport.redis: time (a module global, replaced)
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kombu.transport import redis as kombu_redis

from shared import clock as shared_clock
from shared.clock import RedisClock

__all__ = ["REMIND_S", "SkewReport", "remind", "start"]

log = logging.getLogger("fleet.clock")

REMIND_S = 600.0  # a skew that lasts is warned about again this often
_report: SkewReport | None = None  # this worker's (start)


class SkewReport:
    """Reports each sample's skew: the gauge always, a log line when it crosses the bound.

    Args:
        warn_s: the bound (seconds, either way); 0 turns the warnings off.
        gauge: the ``fleet_worker_clock_skew_seconds`` child of this worker (or a null one).
    """

    def __init__(self, warn_s: float, gauge: Any) -> None:
        self.warn_s = warn_s
        self.gauge = gauge
        self.warned_at: float | None = None  # the skew last warned about (None: within)
        self.warned_mono = 0.0
        self.skew_s: float | None = None

    def __call__(self, clock: RedisClock) -> None:
        skew = clock.skew_s
        if skew is None:
            return
        self.skew_s = skew
        self.gauge.set(skew)
        if self.warn_s <= 0:
            return
        if abs(skew) > self.warn_s:
            if (
                self.warned_at is None
                or abs(skew - self.warned_at) > self.warn_s
                or time.monotonic() - self.warned_mono >= REMIND_S
            ):
                self.warn(skew)
        elif self.warned_at is not None:
            self.warned_at = None
            log.info(
                "this host's clock is back within %.3f s of Redis' (%+.3f s)", self.warn_s, skew
            )

    def warn(self, skew: float) -> None:
        self.warned_at, self.warned_mono = skew, time.monotonic()
        log.warning(
            "this host's clock is %+.3f s off Redis' (bound %.3f s, [redis] clock_skew_warn_s): "
            "deadlines, leases and liveness use Redis' clock; fix the host's time sync (NTP) "
            "for its logs",
            skew,
            self.warn_s,
        )

    def remind(self) -> None:
        """Warn again now if the last sample's skew is past the bound."""
        if self.skew_s is not None and 0 < self.warn_s < abs(self.skew_s):
            self.warn(self.skew_s)


def start(clock: RedisClock, warn_s: float, gauge: Any) -> RedisClock:
    """Make ``clock`` this worker's time (see the module docstring) and take its first
    sample now; returns it. Redis not answering yet is no error: the lease keeper samples
    again at its next renewal, meanwhile the local clock stands in."""
    global _report
    _report = SkewReport(warn_s, gauge)
    clock.on_sample(_report)
    shared_clock.install(clock)
    kombu_redis.time = clock.peek  # type: ignore[attr-defined]  # scores, scan ceiling
    if not clock.refresh():
        log.warning("Redis' TIME not read yet; the local clock stands in until it is")
    return clock


def remind() -> None:
    """Warn again about a skew past the bound (the worker calls it once ready, its logging
    configured); nothing before :func:`start`."""
    if _report is not None:
        _report.remind()
