"""Queue depth and demand, read from Redis in one atomic step (for ``fleet exporter``).

A queue's requests are in one of two places until they finish:

- **waiting**: in one of the queue's priority lists (``shared.schema.priority_list_key``);
  ``LLEN`` of one list (what Celery's tools chart) misses the other nine.
- **reserved**: delivered to a worker and recorded in kombu's ``unacked`` hash until the
  worker acks it, which a batching worker does only after the result is stored. That covers
  the prefetch window, what the batcher holds and what runs; and the messages of a dead
  worker until its leases lapse. The hash holds every queue's messages: each entry is
  ``[payload, exchange, routing_key]`` and is attributed to its queue by the routing key.

``demand = waiting + reserved`` is therefore never below the number of submitted but
unfinished requests (it may be above it by the requests whose result is stored and whose ack
is on its way). ``LLEN`` alone drops by a whole prefetch window as soon as a worker takes it.

The age of the oldest request comes from the ``fleet_submitted_ms`` message header (epoch
ms, set by ``producer.client.FleetClient.publish``): of the two ends of every priority list
(FIFO within a list; restored messages go to the other end) and of every reserved message.
Messages without the header (plain Celery producers) count in demand but not in the age.

The script reads whole unacked entries, so its cost grows with the reserved messages and
their payload sizes (inline payloads; tensors travel as refs); it runs once per scrape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from shared import clock, schema
from shared.tenants import tenant_list_key

__all__ = [
    "FLEET_HEADER_FIELDS",
    "SUBMITTED_HEADER",
    "QueueReader",
    "QueueStats",
    "fleet_headers",
    "parse_rows",
]

SUBMITTED_HEADER = "fleet_submitted_ms"
# header -> the envelope field it carries
FLEET_HEADER_FIELDS: dict[str, str] = {SUBMITTED_HEADER: "submitted_ms"}


def fleet_headers(env: Any) -> dict[str, Any]:
    """Message headers the fleet adds to Celery's for one request (a ``TaskEnvelope``):
    ``fleet_submitted_ms``, its submit time (epoch ms), which the queue age is read from
    (:data:`FLEET_HEADER_FIELDS`)."""
    return {header: getattr(env, name) for header, name in FLEET_HEADER_FIELDS.items()}


# the read (``queue_stats.lua``: its KEYS, ARGV, reply and keys in its header)
_SCRIPT = resources.files("shared").joinpath("queue_stats.lua").read_text("utf-8")


@dataclass
class QueueStats:
    """One queue's state at one instant.

    ``waiting``: messages per Celery priority step (0..9) in Redis; ``reserved``: messages
    delivered and not acked; ``oldest_submitted_ms``: epoch ms of the oldest request with a
    ``fleet_submitted_ms`` header, ``None`` when it has none.
    """

    queue: str
    waiting: dict[int, int] = field(default_factory=dict)
    reserved: int = 0
    oldest_submitted_ms: float | None = None

    @property
    def waiting_total(self) -> int:
        return sum(self.waiting.values())

    @property
    def demand(self) -> int:
        """Waiting + reserved: never below the submitted-but-unfinished requests."""
        return self.waiting_total + self.reserved

    def oldest_age_s(self, now_s: float | None = None) -> float:
        """Seconds since the oldest request was submitted; 0 when the queue is empty.
        ``now_s``: Redis' time (submit times are on it; default: this process's clock)."""
        if self.oldest_submitted_ms is None:
            return 0.0
        now = clock.now_s() if now_s is None else now_s
        return max(0.0, now - self.oldest_submitted_ms / 1000.0)


def parse_rows(queues: Sequence[str], rows: Sequence[Any]) -> tuple[list[QueueStats], int]:
    """The script's reply as :class:`QueueStats` per queue and the count of reserved
    messages of other queues.

    Raises:
        ValueError: a reply of the wrong shape (a script of another version).
    """
    steps = schema.PRIORITY_STEPS
    if len(rows) != len(queues) + 1:
        raise ValueError(f"queue stats: {len(rows)} rows for {len(queues)} queues")
    out = []
    for q, row in zip(queues, rows, strict=False):
        if len(row) != len(steps) + 2:
            raise ValueError(f"queue stats: row of {len(row)} values for {q!r}")
        oldest = int(row[-1])
        out.append(
            QueueStats(
                queue=q,
                waiting={s: int(n) for s, n in zip(steps, row, strict=False)},
                reserved=int(row[len(steps)]),
                oldest_submitted_ms=None if oldest < 0 else float(oldest),
            )
        )
    return out, int(rows[-1][0])


class QueueReader:
    """Reads :class:`QueueStats` of ``queues`` with one script call.

    Args:
        client: a ``redis.Redis`` (the ``operator`` role may run it: reads and ``EVALSHA``).
        queues: queue names (``shared.schema.queue_name`` / ``realtime_queue_name``).
        tenants: tenants whose messages wait in lists of their own beside each priority list
            (``shared.tenants``): read as rows of their own, added to their queue's
            waiting messages and oldest submit time, and kept apart in :attr:`by_tenant`.
    """

    def __init__(self, client: Any, queues: Sequence[str], tenants: Sequence[str] = ()) -> None:
        self.queues = list(queues)
        self.tenants = list(tenants)
        self._rows = [*self.queues, *(f"{q}\x1f{t}" for q in self.queues for t in self.tenants)]
        steps = schema.PRIORITY_STEPS
        self._keys = [schema.priority_list_key(q, s) for q in self.queues for s in steps]
        self._keys += [
            tenant_list_key(q, s, t) for q in self.queues for t in self.tenants for s in steps
        ]
        self._keys.append(schema.UNACKED_KEY)
        self._script = client.register_script(_SCRIPT)
        self.by_tenant: dict[tuple[str, str], QueueStats] = {}  # (queue, tenant): last read

    def read(self) -> tuple[list[QueueStats], int]:
        """Every queue's stats (its tenants' lists included) and the reserved messages of
        queues not listed.

        Raises:
            redis.RedisError: Redis is unreachable or refused the script.
        """
        args = [len(self._rows), len(schema.PRIORITY_STEPS), *self._rows]
        stats, other = parse_rows(self._rows, self._script(keys=self._keys, args=args))
        queues = {st.queue: st for st in stats[: len(self.queues)]}
        self.by_tenant = {}
        for st in stats[len(self.queues) :]:
            queue, _, tenant = st.queue.partition("\x1f")
            self.by_tenant[(queue, tenant)] = st
            merged = queues[queue]
            for step, n in st.waiting.items():
                merged.waiting[step] = merged.waiting.get(step, 0) + n
            if st.oldest_submitted_ms is not None and (
                merged.oldest_submitted_ms is None
                or st.oldest_submitted_ms < merged.oldest_submitted_ms
            ):
                merged.oldest_submitted_ms = st.oldest_submitted_ms
        return list(queues.values()), other
