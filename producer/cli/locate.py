"""Where a request without a result document is: queued (and how far back), held by a
worker, final, or unknown to the fleet. For ``fleet result`` and ``fleet watch``.

Nothing is written when a request is submitted (the gateway's and ``FleetClient``'s submit
paths are untouched): this reads what the fleet keeps anyway, and only when asked:

1. the queues' priority lists of every modality (``<queue>`` and ``<queue>\\x06\\x16<step>``),
   read with ``LRANGE`` in chunks from the head: a message pushed meanwhile shifts the rest
   towards the tail, so a chunk may read one twice but never skips one (workers take from the
   tail);
2. kombu's ``unacked`` hash (``HSCAN``): messages in a worker's prefetch window or batch;
3. the request's final marker (``fleet:final:<id>``) and result document, and the gateway's
   job document (``fleet:job:<id>``, written before it queues a request).

They are read in the order a request moves (queue, then unacked, then result), so one that
moves while it is looked for is still found. A lease that runs out moves a message back from
``unacked`` to its queue (the other way), so a request found nowhere is looked for once more
before it is called unknown.

A message matches on its Celery header ``id`` (the body is base64: an input text holding the
id cannot match). Reading queued messages needs the ``operator`` role (``LRANGE``/``HSCAN``
on every key: see ``shared.acl``); the producer role may not read other producers' queued
inputs, so with a producer user's credentials only step 3 runs and a request it does not
find is ``unsure``, not unknown.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared import schema
from shared.settings import MODALITIES
from shared.tenants import tenant_list_key

QUEUED = "queued"
HELD = "held"  # in a worker's prefetch window or running batch (kombu's unacked hash)
FINAL = "final"  # a final marker, or a result document written meanwhile
SUBMITTED = "submitted"  # only the gateway's job document: queued, or being queued
UNKNOWN = "unknown"
UNSURE = "unsure"  # not found with credentials that cannot read the queues

CHUNK = 500  # messages per LRANGE / HSCAN step


@dataclass(frozen=True)
class Location:
    """Where a request is. ``queue``: its queue name (queued, held); ``position``: 1 = the
    next one its queue's workers take, ``queued``: messages in that queue (queued only)."""

    where: str
    queue: str = ""
    position: int = 0
    queued: int = 0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"where": self.where}
        if self.queue:
            out["queue"] = self.queue
        if self.where == QUEUED:
            out.update(position=self.position, queued=self.queued)
        return out

    def words(self) -> str:
        """A short phrase for a human line."""
        if self.where == QUEUED:
            return f"queued, position {self.position} of {self.queued} in queue {self.queue!r}"
        if self.where == HELD:
            return f"taken by a worker of queue {self.queue!r}: in its prefetch window or batch"
        if self.where == FINAL:
            return "final"
        if self.where == SUBMITTED:
            return "accepted by the gateway, not found in a queue or a worker"
        if self.where == UNSURE:
            return "queued, or an unknown or expired id: these credentials cannot read the queues"
        return "unknown"


def all_queues(models: Sequence[str] = ()) -> list[str]:
    """Every queue of the fleet: each modality's and its REALTIME one, then ``models`` (the
    queues of the models other than the modalities' defaults: ``producer.ops.exporter``'s
    ``all_queues(settings)``)."""
    out = [q for m in MODALITIES for q in (schema.queue_name(m), schema.realtime_queue_name(m))]
    return out + [q for q in models if q not in out]


def message_id(payload: Any) -> str | None:
    """The Celery task id in a kombu message (``dict`` or its JSON text); ``None`` if none."""
    if isinstance(payload, bytes | str):
        try:
            payload = json.loads(payload)
        except ValueError:
            return None
    headers = payload.get("headers") if isinstance(payload, dict) else None
    tid = headers.get("id") if isinstance(headers, dict) else None
    return tid if isinstance(tid, str) else None


def unacked_entry_match(entry: bytes | str, task_id: str) -> str | None:
    """The routing key (queue) of an ``unacked`` entry (``[payload, exchange, routing_key]``)
    whose message is ``task_id``'s; ``None`` otherwise."""
    needle = task_id.encode() if isinstance(entry, bytes) else task_id
    if needle not in entry:  # type: ignore[operator]
        return None
    try:
        payload, _exchange, routing_key = json.loads(entry)
    except (ValueError, TypeError):
        return None
    return str(routing_key) if message_id(payload) == task_id else None


def queue_position(lengths: list[int], step: int, index_from_head: int) -> int:
    """1-based position of a message in its queue: the messages of the steps before ``step``
    (served first) plus those nearer the tail of its own list (``lengths[step]`` long)."""
    return sum(lengths[:step]) + (lengths[step] - index_from_head)


def list_lengths(client: Any, queues: list[str]) -> list[int]:
    """LLEN of every priority list of ``queues``, queue by queue, step by step (one round
    trip)."""
    with client.pipeline(transaction=False) as pipe:
        for q in queues:
            for step in schema.PRIORITY_STEPS:
                pipe.llen(schema.priority_list_key(q, step))
        return [int(c) for c in pipe.execute()]


def find_in_lists(client: Any, task_id: str, models: Sequence[str] = ()) -> Location | None:
    """Look for ``task_id`` in every queue's priority lists (see the module docstring;
    ``models``: more queues, as :func:`all_queues` takes them)."""
    needle = task_id.encode()
    queues = all_queues(models)
    counts = list_lengths(client, queues)
    n = len(schema.PRIORITY_STEPS)
    for qi, q in enumerate(queues):
        lengths = counts[qi * n : (qi + 1) * n]
        for step, length in enumerate(lengths):
            if not length:
                continue
            key = schema.priority_list_key(q, step)
            start = 0
            while True:
                chunk = client.lrange(key, start, start + CHUNK - 1)
                for i, raw in enumerate(chunk):
                    if needle in raw and message_id(raw) == task_id:
                        now = list_lengths(client, [q])
                        now[step] = max(now[step], start + i + 1)
                        return Location(QUEUED, q, queue_position(now, step, start + i), sum(now))
                if len(chunk) < CHUNK:
                    break
                start += CHUNK
    return None


def find_in_tenant_lists(
    client: Any, task_id: str, tenants: Sequence[str], models: Sequence[str] = ()
) -> Location | None:
    """Look for ``task_id`` in the tenants' own lists (of every queue, ``models``' too); its
    position is the one in its tenant's list (the take serves tenants in turns, so no one
    queue order holds)."""
    needle = task_id.encode()
    for q in all_queues(models):
        for step in schema.PRIORITY_STEPS:
            for t in tenants:
                key = tenant_list_key(q, step, t)
                items = client.lrange(key, 0, -1) if client.llen(key) else []
                for i, raw in enumerate(items):
                    if needle in raw and message_id(raw) == task_id:
                        return Location(QUEUED, q, len(items) - i, len(items))
    return None


def find_in_unacked(client: Any, task_id: str) -> Location | None:
    """Look for ``task_id`` among the messages workers hold (kombu's unacked hash)."""
    for _tag, entry in client.hscan_iter(schema.UNACKED_KEY, count=CHUNK):
        queue = unacked_entry_match(entry, task_id)
        if queue is not None:
            return Location(HELD, queue)
    return None


def trace(client: Any, task_id: str) -> Location | None:
    """``FINAL`` when a final marker or a result document exists, ``SUBMITTED`` when only the
    gateway's job document does (one round trip); else ``None``."""
    with client.pipeline(transaction=False) as pipe:
        pipe.exists(schema.final_key(task_id), schema.result_key(task_id))
        pipe.exists(schema.job_key(task_id))
        final, job = pipe.execute()
    if final:
        return Location(FINAL)
    return Location(SUBMITTED) if job else None


def locate(
    client: Any,
    task_id: str,
    can_read_queues: bool = True,
    models: Sequence[str] = (),
    tenants: Sequence[str] = (),
) -> Location:
    """Where ``task_id`` is (see the module docstring); ``client``: a redis-py client;
    ``models``: the queues of the models that are not a modality's default.

    ``can_read_queues``: False with credentials that may not read the queues (a producer
    user): then only the final traces are looked for. ``tenants``: those whose messages wait
    in lists of their own (``shared.tenants``), looked through after the shared lists.

    Raises:
        redis errors: Redis is unreachable, or refused a command (``NoPermissionError``).
    """
    if not can_read_queues:
        return trace(client, task_id) or Location(UNSURE)
    for _attempt in range(2):
        found = (
            find_in_lists(client, task_id, models)
            or find_in_tenant_lists(client, task_id, tenants, models)
            or find_in_unacked(client, task_id)
            or trace(client, task_id)
        )
        if found is not None:
            return found
    return Location(UNKNOWN)
