"""Redis' clock, the one every fleet timestamp is on, read without a round trip per call.

Why: deadlines (``submitted_ms`` / ``deadline_ms``), lease scores and liveness heartbeats are
written by one host and compared by another. On each host's own wall clock, one host whose
clock is off fails or hides work: a worker at +1 h ended every request with a deadline
``DEADLINE_EXCEEDED``, took every other worker's leases for lapsed (their messages ran twice)
and made the others look dead; at -1 h it looked dead itself. Every fleet process already
talks to Redis, so the fleet keeps every such timestamp on Redis' clock (``TIME``); a host's
own wall clock then only decides what it logs.

:class:`RedisClock` asks ``TIME`` now and then (every ``refresh_s``; sooner when this host's
wall clock stepped against its monotonic clock: an NTP step, a VM resumed) and advances the
answer on the monotonic clock in between: :meth:`RedisClock.now` costs two clock reads and
no round trip, so a producer's submit path stays as cheap as it was. The estimate is off by
at most half the round trip it was sampled with (a sample with a much longer round trip than
the one in use is not adopted unless the one in use is old), plus the monotonic clock's
drift since (parts per million, NTP slews it as it slews the wall clock).

``skew_s`` is this host's wall clock minus Redis' at the last sample: a worker reports it
(``workers.consumer.clock_watch``: a warning past ``[redis] clock_skew_warn_s``, the gauge
``fleet_worker_clock_skew_seconds``). Until a first sample, the clock reads the local wall
clock (the best there is; a process without Redis has no other).

A process may install one clock as its own (:func:`install`; a worker installs the one its
lease keeper refreshes): :func:`now_s` reads it, else the local wall clock. It never does I/O.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["RedisClock", "current", "install", "now_s", "seconds_of"]

log = logging.getLogger("fleet.clock")

DEFAULT_REFRESH_S = 15.0
STEP_S = 0.5  # a wall-minus-monotonic change this large is a step: sample again at once
RETRY_S = 1.0  # a failed or rejected sample is tried again this much later
MIN_RTT_S = 0.005  # round trips below this are all good enough
STALE_REFRESHES = 3  # the sample in use is adopted-over anyway after this many periods


def seconds_of(reply: Any) -> float:
    """Epoch seconds of a ``TIME`` reply: ``[seconds, microseconds]`` (bytes, str or int,
    as redis-py returns it raw or parsed).

    Raises:
        ValueError: not a ``TIME`` reply.
    """
    try:
        if not isinstance(reply, list | tuple):
            raise TypeError
        sec, usec = reply
        return int(sec) + int(usec) / 1e6
    except (TypeError, ValueError):
        raise ValueError(f"not a TIME reply: {reply!r}") from None


class RedisClock:
    """Redis' ``TIME``, estimated between samples on the monotonic clock.

    Args:
        read: returns one ``TIME`` reply (a round trip); ``None``: the clock is only fed by
            :meth:`observe` (an asyncio caller that reads ``TIME`` itself).
        refresh_s: seconds between samples.
        wall, mono: the local wall and monotonic clocks (tests pass fakes).

    Thread safety: every method may be called from any thread; one sample is taken at a
    time (a caller that finds one under way reads the estimate in use).
    """

    def __init__(
        self,
        read: Callable[[], Any] | None,
        refresh_s: float = DEFAULT_REFRESH_S,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self.refresh_s = refresh_s
        self._wall = wall
        self._mono = mono
        # (Redis seconds, monotonic instant they were true at, wall - mono then, rtt, at):
        # one tuple, swapped whole, so a reader never sees half of two samples.
        self._base: tuple[float, float, float, float, float] | None = None
        self._retry_at = 0.0  # monotonic: no sample before (a failure, a rejected one)
        self._lock = threading.Lock()
        self._listeners: list[Callable[[RedisClock], None]] = []
        self.skew_s: float | None = None  # local wall - Redis at the last adopted sample
        self.samples = 0
        self.failures = 0

    # -- reading ---------------------------------------------------------------------------
    def peek(self) -> float:
        """Redis' time now (epoch seconds), from the sample in use; never any I/O."""
        base = self._base
        if base is None:
            return self._wall()
        return base[0] + (self._mono() - base[1])

    def now(self) -> float:
        """Redis' time now (epoch seconds); takes a sample first when one is due (one
        round trip every ``refresh_s``, none otherwise)."""
        if self._read is not None and self.due():
            self.refresh()
        return self.peek()

    @property
    def sampled(self) -> bool:
        """Whether a ``TIME`` reply was adopted yet (else :meth:`peek` is the wall clock)."""
        return self._base is not None

    def due(self) -> bool:
        """Whether a sample should be taken now: none yet, the one in use is older than
        ``refresh_s``, or the wall clock stepped against the monotonic one since."""
        base, mono = self._base, self._mono()
        if mono < self._retry_at:
            return False
        if base is None:
            return True
        return mono - base[4] >= self.refresh_s or self._stepped(base, mono)

    def _stepped(self, base: tuple[float, float, float, float, float], mono: float) -> bool:
        return abs((self._wall() - mono) - base[2]) > STEP_S

    # -- sampling --------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Take a sample now (one round trip); ``False`` when none was adopted (Redis did
        not answer: the estimate in use stays, and the next try waits ``RETRY_S``)."""
        if self._read is None or not self._lock.acquire(blocking=False):
            return False
        try:
            sent = self._mono()
            try:
                reply = self._read()
            except Exception as exc:
                self.failures += 1
                self._retry_at = self._mono() + RETRY_S
                log.debug("reading Redis' TIME failed: %s", exc)
                return False
            return self.observe(reply, sent, self._mono())
        finally:
            self._lock.release()

    def observe(self, reply: Any, sent: float, received: float) -> bool:
        """Adopt a ``TIME`` reply read between the monotonic instants ``sent`` and
        ``received``, unless its round trip is far longer than the sample in use's and that
        one is still young and no step happened (its midpoint would be the worse estimate).
        Returns whether it was adopted.

        Raises:
            ValueError: ``reply`` is not a ``TIME`` reply.
        """
        redis_s = seconds_of(reply)
        rtt = max(0.0, received - sent)
        mono, wall = self._mono(), self._wall()
        base = self._base
        if (
            base is not None
            and rtt > max(2.0 * base[3], MIN_RTT_S)
            and received - base[4] < STALE_REFRESHES * self.refresh_s
            and not self._stepped(base, mono)
        ):
            self._retry_at = mono + RETRY_S
            return False
        mid = (sent + received) / 2.0
        self._base = (redis_s, mid, wall - mono, rtt, received)
        self.skew_s = (wall - (mono - mid)) - redis_s  # the wall clock at mid, less Redis'
        self.samples += 1
        self._retry_at = 0.0
        for listener in list(self._listeners):
            try:
                listener(self)
            except Exception:  # a listener's bug must not stop the clock
                log.exception("clock listener failed")
        return True

    def on_sample(self, listener: Callable[[RedisClock], None]) -> None:
        """Call ``listener(clock)`` after every adopted sample (from the sampling thread)."""
        self._listeners.append(listener)

    @property
    def rtt_s(self) -> float | None:
        """Round trip of the sample in use (its estimate is off by at most half of it)."""
        base = self._base
        return None if base is None else base[3]


_process: RedisClock | None = None


def install(clock: RedisClock | None) -> None:
    """Make ``clock`` this process's (``None``: the local wall clock again)."""
    global _process
    _process = clock


def current() -> RedisClock | None:
    """This process's clock, or ``None`` (it reads its local wall clock)."""
    return _process


def now_s() -> float:
    """Epoch seconds on this process's clock (Redis' once installed); never any I/O."""
    clock = _process
    return time.time() if clock is None else clock.peek()
