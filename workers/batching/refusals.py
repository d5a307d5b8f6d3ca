"""Redis (the broker) refusing a worker's writes while it still answers: what the worker does.

Four answers mean "I am here, but I will not write": ``MISCONF`` (Redis cannot persist: the
disk under its AOF is full; it refuses ``PING`` too), ``OOM`` (``maxmemory`` reached under
``noeviction``), ``READONLY`` (the node became a replica) and ``NOPERM`` (an ACL rule took the
worker user's write commands). None is a lost connection, so reconnecting does not help,
and none is a bug of the request at hand. Each ends by itself (space freed, memory freed,
the node promoted, the rule undone), and a worker must still be there then: it must not
exit (Celery ends a worker on any error its event loop does not expect), and it must not
go on fetching messages it cannot lease, count or settle.

So every part of a worker that writes reports what Redis answered to :data:`REFUSALS`
(:meth:`Refusals.refused`, :meth:`Refusals.accepted`), by part: ``fetch`` (the take script,
the fetch connection's ``PING``, ``BRPOP``), ``lease`` (renewals and heartbeats),
``results``, ``scan`` (kombu's restore scan) and ``connect`` (a channel's first ``PING``).
The worker *refuses* while some part's last write was refused, less than ``STALE_S`` ago
(each part retries sooner than that; one that stops trying stops counting). ``scan`` and
``connect`` do not retry while Redis refuses (nothing is lost by waiting): any other part's
accepted write ends their refusal too. Then:

- it does not fetch (``workers.consumer.channel``), and retries with backoff (:func:`backoff_s`);
- it keeps what it holds under lease: the lease keeper retries every second at most, so it
  renews within about a second of Redis accepting writes again (``workers.consumer.lease``);
- it says so once, in its log (``Redis refuses writes (MISCONF: ...)``, then ``Redis
  accepts writes again after ...``) and in ``fleet_worker_broker_refusing{reason}``;
- its restore scans wait (:meth:`Refusals.scans_allowed`). While writes were refused no
  holder could renew its leases, so every lease held then looks lapsed when writes resume,
  held by a live worker or not; a scan then would hand live work to a second worker (a
  duplicate execution). Scans resume ``hold_s`` after the last refusal this worker saw
  (the lease period and the longest retry: every live holder has renewed by then), and a
  freshly started worker, which may have seen nothing of a refusal that just ended, scans
  only ``first_scan_s`` after its start. A fault long enough to make a lease lapse (longer
  than a renewal period) is seen by every running worker: each tries a write at least
  every renewal period (a heartbeat, a renewal, a take).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from shared.errors import BrokerUnavailable

__all__ = ["REASONS", "REFUSALS", "Refusals", "backoff_s", "reason_of"]

log = logging.getLogger("fleet.broker")

REASONS: tuple[str, ...] = BrokerUnavailable.REFUSALS
STALE_S = 5.0  # a part's refusal counts this long after it was last seen (parts retry sooner)
BACKOFF_S = (0.25, 0.5, 1.0)  # between a part's tries while refused; then the last again
PASSIVE = ("scan", "connect")  # parts that wait for another part's write instead of retrying


def reason_of(exc: BaseException) -> str | None:
    """The refusal ``exc`` stands for (one of :data:`REASONS`), or ``None``: any other error
    (a lost connection, a bad command) is not Redis refusing to write. The producers' rule
    (``shared.redis_refusal.refusal_of``), imported here at the first call: the engine's
    Celery-free parts (``workers.batching.completion``) import this module, and import no Redis
    client."""
    from shared.redis_refusal import refusal_of

    return refusal_of(exc)


def backoff_s(tries: int) -> float:
    """The wait before try ``tries + 1`` of a write Redis refused ``tries`` times in a row."""
    return BACKOFF_S[min(max(tries, 1), len(BACKOFF_S)) - 1]


class Refusals:
    """What this process saw of Redis refusing its writes, by part; see the module.

    Args:
        clock: monotonic seconds (tests pass their own).

    Thread safety: every method may be called from any thread.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._parts: dict[str, tuple[str, float, int]] = {}  # part -> reason, last seen, tries
        self._began: float | None = None  # when the refusal now under way began
        self._last = -math.inf  # the last refusal seen, any part
        self._scans_from = -math.inf
        self.hold_s = 0.0  # restore scans wait this long after the last refusal
        self.refusals = 0  # refusals seen (every part, every try)
        self.episodes = 0  # refusals that began (each logged once)
        self.held: Callable[[], int] = lambda: 0  # messages this worker holds (for the log)

    def configure(self, hold_s: float, first_scan_s: float) -> None:
        """Restore scans wait ``hold_s`` after a refusal, and ``first_scan_s`` from now."""
        self.hold_s = hold_s
        self._scans_from = self._clock() + first_scan_s

    # -- what the parts report ------------------------------------------------------------
    def refused(self, part: str, reason: str, exc: BaseException | str = "") -> float:
        """Redis refused ``part``'s write (``reason``, ``exc`` its error); returns how long
        ``part`` waits before it tries again."""
        now = self._clock()
        with self._lock:
            tries = self._parts.get(part, ("", 0.0, 0))[2] + 1
            self._parts[part] = (reason, now, tries)
            self._last = now
            self.refusals += 1
            began = self._began is None
            if began:
                self._began = now
                self.episodes += 1
        if began:
            log.warning(
                "Redis refuses writes (%s: %s): not fetching, holding %d messages under "
                "lease, retrying with backoff until it accepts writes again",
                reason, _first_line(exc), self.held(),
            )  # fmt: skip
        else:
            log.debug("Redis refused %s's write (%s), try %d", part, reason, tries)
        return backoff_s(tries)

    def accepted(self, part: str) -> None:
        """Redis accepted ``part``'s write."""
        if not self._parts:  # the common case, without the lock
            return
        with self._lock:
            for done in (part, *PASSIVE):
                self._parts.pop(done, None)
            ended = self._settle(self._clock())
        if ended is not None:
            self._log_end(ended)

    # -- what the worker asks -------------------------------------------------------------
    def reasons(self) -> set[str]:
        """The reasons Redis refuses this worker's writes now (empty: it accepts them)."""
        if not self._parts and self._began is None:
            return set()
        with self._lock:
            ended = self._settle(self._clock())
            out = {reason for reason, _, _ in self._parts.values()}
        if ended is not None:
            self._log_end(ended)
        return out

    def refusing(self, part: str | None = None) -> bool:
        """Whether Redis refuses writes now (``part``: that part's writes)."""
        if part is None:
            return bool(self.reasons())
        self.reasons()  # forgets stale parts
        return part in self._parts

    def scans_allowed(self) -> bool:
        """Whether a restore scan may return lapsed leases now: not while Redis refuses
        writes, nor within ``hold_s`` of the last refusal (live holders renew first), nor
        before ``first_scan_s`` after :meth:`configure`."""
        if self.reasons():
            return False
        now = self._clock()
        return now >= self._last + self.hold_s and now >= self._scans_from

    def snapshot(self) -> dict[str, object]:
        """For ``fleet_stats``."""
        return {
            "refusing": sorted(self.reasons()),
            "refusals": self.refusals,
            "episodes": self.episodes,
            "scans_allowed": self.scans_allowed(),
        }

    # -- inside -------------------------------------------------------------------------
    def _settle(self, now: float) -> float | None:
        """Forget parts not refused for ``STALE_S``; when none is left and a refusal was
        under way, end it and return how long it lasted (under the lock)."""
        for part, (_, seen, _) in list(self._parts.items()):
            if now - seen > STALE_S:
                del self._parts[part]
        if self._parts or self._began is None:
            return None
        began, self._began = self._began, None
        return now - began

    def _log_end(self, lasted_s: float) -> None:
        log.warning(
            "Redis accepts writes again after %.1f s of refusals: fetching resumes, leases are "
            "renewed; restore scans wait %.1f s so that every holder renews first",
            lasted_s, self.hold_s,
        )  # fmt: skip


def _first_line(exc: BaseException | str) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else "-"


REFUSALS = Refusals()  # this process's
