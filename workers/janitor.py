"""The shared-memory janitor every worker runs: lease renewals, then ``ShmStore.gc``, on a timer.

Segments whose TTL passed or whose owner process died (a producer or a worker killed with
SIGKILL), temp files of dead writers and released files kept for reuse that nobody reused for
``recycle_idle_s`` are reclaimed without anyone having to run ``fleet shm gc``. Every worker
process runs one (``[transport] janitor_interval_s``, 0 turns it off); several collecting at
once is harmless (``gc`` tolerates files vanishing under it).

Before each collection it renews the leases of input segments bound to requests that may
still run (``workers.batching.tensor_lease.SegmentRenewer``): a video waiting in a backlog longer
than its TTL is kept, on this host, for as long as its request has no final result.
"""

from __future__ import annotations

import logging
import threading

from shared.settings import Settings
from workers.batching.tensor_lease import SegmentRenewer

log = logging.getLogger(__name__)


class ShmJanitor:
    """A daemon thread that calls ``gc()`` on the process's store every ``interval_s``.

    Args:
        settings: fleet settings (``[transport]``).
        interval_s: seconds between collections (> 0).
        renewer: renews bound segments' leases before each collection (default: one with a
            Redis client of its own, connected on first need).
    """

    def __init__(
        self, settings: Settings, interval_s: float, renewer: SegmentRenewer | None = None
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.settings = settings
        self.interval_s = float(interval_s)
        self.removed = 0  # files reclaimed so far
        self.renewer = renewer or SegmentRenewer(settings, self.interval_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shm-janitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def collect(self) -> list[str]:
        """Renew what is due, then collect; returns what it removed (see ``ShmStore.gc``)."""
        from shared.transport import process_store

        store = process_store(self.settings, role="worker")
        self.renewer.renew_due(store)  # first: gc must not take what a running request needs
        removed = store.gc()
        self.removed += len(removed)
        return removed

    def _run(self) -> None:
        from shared.errors import FleetError

        while not self._stop.wait(self.interval_s):
            try:
                self.collect()
            except FleetError as exc:  # no usable root (the startup log said why): stop
                log.warning("shm janitor stopped: %s", exc)
                return
            except Exception:  # a janitor must outlive a bad file
                log.exception("shm janitor: collection failed")
