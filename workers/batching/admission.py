"""Admission: a received request becomes a pending request for the batcher, or a coded
refusal that fails it alone, at once.

Two steps, both on the worker's event-loop thread:

1. :func:`screen` (cheap, before Redis is asked anything): positional arguments, the
   envelope's schema, its priority, the modality and model this worker serves, the deadline.
2. :meth:`Admission.admit` (after its arrival was recorded and its deaths counted: the
   poison accounting below): refuse a poison message, strip an injected fault, renew
   its /dev/shm inputs, ``prepare`` them, and build the
   :class:`~workers.batching.batcher.Pending` (a suspect in a bucket of its own).

No Celery here: a request is any object with an ``id``.

Poison accounting and the batch gate, on blame records in Redis: what may run, and the
evidence for it.

The gate (:class:`InFlight`), before a batch runs, drops requests that already have a final
result and records the others. One round trip per batch (``_BEGIN``):

- if ``fleet:final:<id>`` exists, the request already has its final result (a redelivered
  or duplicated copy of a finished request): it is not run, only acked
  (``workers.batching.completion`` writes that marker with the first final result);
- the calling lane's blame record is set to the ids of the others, the members that run.

Poison accounting (:class:`Deliveries`, :class:`Isolation`) counts the deaths a message caused,
refuses a message that keeps killing workers, and runs a suspect alone. The evidence lives in
Redis as *blame records* (:class:`InFlight`: keys, the Lua scripts ``inflight_begin.lua`` and
``blame_arrive.lua``, TTL): every worker process incarnation (host, pid and a random token)
writes ``fleet:blame:<incarnation>:<slot>``, a string of the task ids that are to blame if it
dies now, with ``SET ... EX ttl``:

- slot ``decode``: the arrival group being decoded (set when a fetch's messages arrive,
  before their inputs are decoded; emptied once they decoded, before any of them may run);
- one slot per lane (inference thread): the batch it runs (set by the gate).

``fleet:blame:index`` lists the records' names (added with a record's first write, and again
whenever it may have expired since its last; a lookup drops a name whose record expired). A
record of a live worker is rewritten with each group or batch; a dead worker's stays until its
TTL passes. The cost is per arrival group and per batch, never per request: a group's record
set and emptied, a batch's record set inside the gate's script.

A message's *deaths* are the other incarnations whose records name it: each died (or lost its
lease) decoding or running it. Only a message marked redelivered is looked up (kombu's restore
marks ``delivery_info['redelivered']`` and the ``redelivered`` header: a lapsed lease, the
fleet's give-back, a shutdown's restore); a message that was never returned has no death, and
its arrival costs no lookup. :meth:`InFlight.arrive` answers ``1 + deaths`` per request, the
"deliveries so far" that :class:`Deliveries` judges.

The decisions and the safety nets around them take a :class:`Counters` object, so they can be
tested without Redis:

- a delivery that finds ``max_deliveries`` deaths fails ``WORKER_LOST`` instead of running;
- a delivery with an earlier death (a *suspect*) runs in a bucket of its own, so it cannot
  take innocent batch-mates down with it again, and alone on the worker (:class:`Isolation`):
  no other batch runs and no arrival is being decoded meanwhile, and the batches before it
  have their results stored (the runner, ``workers.batching.execution.BatchRunner``, waits
  for the loop), its own stored before the next batch starts, so a death while it runs is
  blamed on it only;
- an arrival group leaves the decode record before any of its members may run, so a member
  that kills the worker is not blamed twice, nor its group-mates once; a worker dying while a
  request merely waits in the prefetch window blames nobody;
- a shutdown or a give-back is not a death: the requests given back are taken out of the
  records that name them (this process knows which ids each of its records holds), and a
  worker that stopped gracefully deletes its records (:meth:`InFlight.retire`);
- own records are never counted: a message that comes back to the incarnation that ran it
  (its lease lapsed while Redis refused writes) did not kill it;
- an incarnation is counted once per message, whichever of its records name it;
- Redis refusing a write never stops a request: recording is a safety net, and result
  writes are first-wins.

A lane's record stays after its batch finished, until the lane's next batch overwrites it.
That is safe: a finished member's result is stored and its message acked, so it is never
redelivered and nobody looks it up; a member waiting for an in-place retry of a transient
fault (``workers.batching.execution.RetryPolicy``) stays blamed until then, as it was while
it ran; a member given back is taken out. A record of a dead incarnation lives for its TTL,
refreshed whenever a lookup counts it, so that the deaths of a message that keeps coming back
add up.

Known gap: Redis behind Sentinel can lose a worker's fetch in a failover (the pop never
reached a replica); the message is then delivered again as it was, not marked redelivered,
and a death with it before the failover is not counted on that delivery (its next
redelivery counts it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol

from shared import schema
from shared.errors import (
    DeadlineExceeded,
    FleetError,
    InvalidInput,
    ModelNotFound,
    UnsupportedModality,
    WorkerLost,
)
from shared.schema import Priority, TaskEnvelope
from shared.tracing import Tracing
from workers.batching.batcher import Pending, Work
from workers.batching.inject import RequestInjector
from workers.batching.tensor_lease import renew_inputs
from workers.models.base import ModelAdapter

if TYPE_CHECKING:
    from shared.redis_client import Waiter

__all__ = [
    "Admission",
    "BlameBook",
    "Counters",
    "Deliveries",
    "Isolation",
    "Refusal",
    "Served",
    "encode_id",
    "incarnation",
    "redelivered",
    "screen",
    "suspect_bucket",
]

log = logging.getLogger("fleet.engine")


@dataclass(frozen=True, slots=True)
class Served:
    """What this worker serves: one modality, its models (by ``[models.<name>]`` table).

    Attributes:
        model: the modality's default model (what an envelope naming none means).
        models: the tables this worker serves; empty: ``model`` alone.
    """

    modality: str
    model: str
    models: tuple[str, ...] = ()

    def check(self, env: TaskEnvelope) -> None:
        """Refuse an envelope for another modality, or naming a model this worker lacks.

        Raises:
            UnsupportedModality: ``env.modality`` is not this worker's.
            ModelNotFound: ``env.model`` (``None``: the default) is not a model this worker
                serves.
        """
        if env.modality != self.modality:
            raise UnsupportedModality(
                f"modality {env.modality!r} sent to the {self.modality!r} queue"
            )
        served = self.models or (self.model,)
        if (self.model if env.model is None else env.model) not in served:
            raise ModelNotFound(
                f"model {env.model or self.model!r} is not served by this worker; it serves "
                f"{', '.join(served)} (a null 'model' is {self.modality}'s default, "
                f"{self.model!r})"
            )


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request failed at admission: its coded error and its priority's metric label
    (``"unknown"`` until the priority parsed)."""

    error: FleetError
    priority: str = "unknown"


def screen(args: Any, kwargs: Any, served: Served) -> TaskEnvelope | Refusal:
    """The envelope of a task called with ``args``/``kwargs``, or why it is refused."""
    label = "unknown"
    try:
        if args:
            raise InvalidInput(
                "positional task arguments are not accepted; the envelope travels as "
                "the keyword argument 'request'"
            )
        env = TaskEnvelope.from_kwargs(kwargs)
        # Only the four classes become metric labels: a producer sending arbitrary
        # priority strings must not create unbounded Prometheus series.
        Priority.parse(env.priority)
        label = env.priority
        served.check(env)
        if env.expired():  # waited in Redis past its deadline: do not even validate it
            raise DeadlineExceeded("deadline passed before it could run")
    except FleetError as exc:
        return Refusal(exc, label)
    return env


class Admission:
    """Decode screened requests into pending ones.

    Args:
        adapter: the model adapter (``prepare`` is called here).
        deliveries: poison accounting (refusal and suspect buckets).
        faults: the request injector (strips ``_inject`` when injection is on).
        tracing: the engine's tracing hooks.
        store: returns the worker's /dev/shm store (called only for inputs with refs).
        clock: monotonic seconds; a request arrives once it is prepared.
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        deliveries: Deliveries,
        faults: RequestInjector,
        tracing: Tracing,
        store: Callable[[], Any],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.adapter, self.deliveries, self.faults = adapter, deliveries, faults
        self.tracing, self.store, self.clock = tracing, store, clock

    def admit(
        self, req: Any, env: TaskEnvelope, count: int, twins: list[Any] | None = None
    ) -> Pending | FleetError:
        """``req`` as a pending request (its :class:`Work` in ``item``), or its error.

        Args:
            count: its deliveries with its worker's death so far, this one included
                (1 + deaths; 0: not known).
            twins: more copies of its task id, already held with it.
        """
        try:
            refusal = self.deliveries.refusal(req.id, count)
            if refusal is not None:
                raise refusal
            inputs, fault = env.inputs, None
            if self.faults.enabled:
                inputs, fault = self.faults.split(inputs)
            # Its /dev/shm inputs live while it may run: renewed before prepare maps them.
            if self.adapter.tensor_inputs:
                renew_inputs(self.store, inputs, req.id)
            if fault is not None:
                self.faults.on_prepare(fault)
            with self.tracing.in_request(req):
                prepared = self.adapter.prepare_for(env.model, inputs)
        except Exception as exc:  # an adapter bug must not kill the consumer either
            if isinstance(exc, FleetError):
                return exc
            log.exception("prepare failed id=%s", req.id)
            return InvalidInput(f"input could not be prepared: {exc}")
        now = self.clock()
        work = Work(req, env, prepared, now, fault=fault, twins=[] if twins is None else twins)
        work.suspect = self.deliveries.suspect(count)
        return work.pending(now, self.deliveries.bucket(prepared.bucket, req.id, count))


MAX_DELIVERIES = 3  # deliveries whose worker died running them, after which a message is poison


FINAL = -1  # _BEGIN's answer for a request that has its final result already


# the batch gate (``inflight_begin.lua``) and the arrival's count (``blame_arrive.lua``): their
# KEYS, ARGV, reply and keys in their headers
_BEGIN = resources.files("workers.batching").joinpath("inflight_begin.lua").read_text("utf-8")
_ARRIVE = resources.files("workers.batching").joinpath("blame_arrive.lua").read_text("utf-8")

DECODE_SLOT = "decode"  # the record of the arrival group being decoded


def incarnation() -> str:
    """This worker process incarnation's name: host, pid and a random token (a pid is
    reused by a later process, on this host or in a container's restart)."""
    return f"{socket.gethostname().split('.')[0]}:{os.getpid()}:{secrets.token_hex(4)}"


def encode_id(task_id: str) -> str:
    """A task id as a blame record holds it: without spaces (records are space-separated),
    so an id is found whole, never as a piece of another."""
    return task_id.replace("%", "%25").replace(" ", "%20")


class BlameBook:
    """What this incarnation's blame records hold, in process memory (no Redis): which ids
    each slot's record names, the slot of each lane thread, and when each record was last
    indexed (pure bookkeeping; :class:`InFlight` writes what it decides).

    Args:
        incarnation: this worker process incarnation's name (:func:`incarnation`).
        ttl_s: the records' TTL.
        clock: monotonic seconds.
    """

    def __init__(
        self, incarnation: str, ttl_s: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.incarnation, self.ttl_s, self.clock = incarnation, ttl_s, clock
        self.prefix = schema.blame_record_key(incarnation, "")
        self.slots: dict[str, list[str]] = {}
        self._lanes: dict[int, str] = {}
        self._indexed: dict[str, float] = {}  # slot -> when its record was last written
        self._lock = threading.Lock()

    def key(self, slot: str) -> str:
        return schema.blame_record_key(self.incarnation, slot)

    def lane(self) -> str:
        """The calling lane thread's slot (``lane-1``, ``lane-2``...)."""
        ident = threading.get_ident()
        with self._lock:
            slot = self._lanes.get(ident)
            if slot is None:
                slot = self._lanes[ident] = f"lane-{len(self._lanes) + 1}"
            return slot

    def put(self, slot: str, task_ids: Sequence[str]) -> bool:
        """``slot``'s record is written to name ``task_ids``; whether its name must be added
        to the index with this write: on the first write, and whenever the record may have
        expired since the last one (a lookup then drops its name from the index). Half the
        TTL is the margin for the clocks."""
        now = self.clock()
        with self._lock:
            self.slots[slot] = list(task_ids)
            last = self._indexed.get(slot)
            self._indexed[slot] = now
            return last is None or now - last >= self.ttl_s / 2

    def hold(self, slot: str, task_ids: Sequence[str]) -> None:
        """``slot``'s record names ``task_ids`` (written by a script that decided which)."""
        with self._lock:
            self.slots[slot] = list(task_ids)

    def unsure(self, slot: str) -> None:
        """A write of ``slot``'s record may have failed: index it again with the next one."""
        with self._lock:
            self._indexed.pop(slot, None)

    def remove(self, task_ids: Sequence[str]) -> dict[str, list[str]]:
        """Take ``task_ids`` out of the records that name them; those records' new contents,
        by slot (nothing for ids no record names)."""
        gone = set(task_ids)
        with self._lock:
            changed = {
                slot: [t for t in ids if t not in gone]
                for slot, ids in self.slots.items()
                if gone.intersection(ids)
            }
        return changed

    def retire(self) -> list[str]:
        """Forget every record (the incarnation stops); the slots it had."""
        with self._lock:
            slots = list(self.slots)
            self.slots.clear()
            self._indexed.clear()
            return slots

    @staticmethod
    def value(task_ids: Sequence[str]) -> str:
        return " ".join(encode_id(t) for t in task_ids)


class InFlight:
    """Poison accounting's blame records and the batch gate, on a Redis client (thread-safe).

    Each worker process incarnation (:func:`incarnation`) writes records
    ``fleet:blame:<incarnation>:<slot>``, strings of the task ids that would be blamed if it
    died now: slot ``decode`` names the arrival group being decoded, one slot per lane thread
    names the batch it runs. ``fleet:blame:index`` lists the records' names. A redelivered
    message's deaths are the other incarnations whose records name it.

    Args:
        client: a ``redis.Redis`` client.
        ttl_s: how long a record outlives its last write (it must outlive every redelivery of
            a dead worker's message).
        waiter: Redis behind Sentinel: a ``FINAL`` answer is confirmed on the primary
            before a copy is acked unrun. An old primary keeps answering until it is
            demoted, and a final marker it holds from a write no replica confirmed is lost
            with it; acking a copy on its word would lose the request.
        name: this incarnation's name (default: :func:`incarnation`).
    """

    def __init__(
        self, client: Any, ttl_s: int, waiter: Waiter | None = None, name: str | None = None
    ) -> None:
        self.client = client
        self.waiter = waiter
        self.ttl_s = ttl_s
        self.book = BlameBook(name or incarnation(), ttl_s)
        self._begin = client.register_script(_BEGIN)
        self._arrive = client.register_script(_ARRIVE)

    def _write(self, slots: dict[str, Sequence[str]]) -> None:
        """Write these records (one round trip)."""
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for slot, ids in slots.items():
                    key = self.book.key(slot)
                    pipe.set(key, self.book.value(ids), ex=self.ttl_s)
                    if self.book.put(slot, ids):
                        pipe.sadd(schema.BLAME_INDEX_KEY, key)
                pipe.execute()
        except Exception:
            for slot in slots:
                self.book.unsure(slot)
            raise

    def begin(self, task_ids: Sequence[str]) -> list[int]:
        """For each id: ``FINAL`` (do not run) or 1 (the calling lane's record names it).

        Raises:
            redis.RedisError: Redis is unreachable (the caller runs the batch anyway:
                counting is a safety net, and result writes are first-wins).
        """
        if not task_ids:
            return []
        slot = self.book.lane()
        ks = [schema.final_key(tid) for tid in task_ids]
        ks += [self.book.key(slot), schema.BLAME_INDEX_KEY]
        index = self.book.put(slot, task_ids)
        args = [self.ttl_s, "1" if index else "0", *(encode_id(t) for t in task_ids)]
        try:
            states = [int(x) for x in self._begin(keys=ks, args=args)]
        except Exception:
            self.book.unsure(slot)
            raise
        self.book.hold(slot, [t for t, st in zip(task_ids, states, strict=True) if st != FINAL])
        if self.waiter is not None and FINAL in states:
            finals = [i for i, st in enumerate(states) if st == FINAL]
            with self.client.pipeline(transaction=False) as pipe:
                for i in finals:
                    pipe.exists(schema.final_key(task_ids[i]))
                # ReplicationUncertain: the caller runs the batch (writes are first-wins)
                from shared.redis_client import execute_waiting

                found = execute_waiting(self.client, pipe, self.waiter)
            for i, present in zip(finals, found, strict=True):
                if not present:
                    states[i] = 1
            if not all(found):  # these run too: the lane's record names them
                ran = [t for t, st in zip(task_ids, states, strict=True) if st != FINAL]
                self._write({slot: ran})
        return states

    def arrive(
        self, task_ids: Sequence[str], redelivered: Sequence[bool] | None = None
    ) -> list[int]:
        """Record the arrival group ``task_ids`` as being decoded; each one's deliveries so far
        with its worker's death (1 + deaths). Only redelivered ids (``redelivered``; ``None``:
        not known, all) are looked up: a message returned after its worker died is marked
        redelivered; any other has no death to count.

        Raises:
            redis.RedisError: Redis is unreachable.
        """
        if not task_ids:
            return []
        flags = [True] * len(task_ids) if redelivered is None else list(redelivered)
        look = [t for t, r in zip(task_ids, flags, strict=True) if r]
        if not look:
            self._write({DECODE_SLOT: task_ids})
            return [1] * len(task_ids)
        index = self.book.put(DECODE_SLOT, task_ids)
        key = self.book.key(DECODE_SLOT)
        args = [
            self.ttl_s,
            self.book.value(task_ids),
            "1" if index else "0",
            self.book.prefix,
            *(encode_id(t) for t in look),
        ]
        try:
            found = iter(
                [int(x) for x in self._arrive(keys=[key, schema.BLAME_INDEX_KEY], args=args)]
            )
        except Exception:
            self.book.unsure(DECODE_SLOT)
            raise
        return [1 + next(found) if r else 1 for r in flags]

    def uncount(self, task_ids: Sequence[str]) -> None:
        """Take ``task_ids`` out of this incarnation's records (they decoded, or were given
        back unrun): a record left with nothing is written empty, not deleted, so that its
        name stays valid in the index."""
        changed = self.book.remove(task_ids)
        if changed:
            self._write(changed)

    def retire(self) -> None:
        """This incarnation stops (a graceful shutdown, everything settled or given back):
        its records and their names in the index go."""
        keys = [self.book.key(slot) for slot in self.book.retire()]
        if keys:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.delete(*keys)
                pipe.srem(schema.BLAME_INDEX_KEY, *keys)
                pipe.execute()


class Counters(Protocol):
    """Poison accounting's store (``workers.batching.admission.InFlight`` on Redis)."""

    def arrive(
        self, task_ids: Sequence[str], redelivered: Sequence[bool] | None = None
    ) -> list[int]: ...

    def begin(self, task_ids: Sequence[str]) -> list[int]: ...

    def uncount(self, task_ids: Sequence[str]) -> None: ...

    def retire(self) -> None: ...


def redelivered(req: Any) -> bool:
    """Whether ``req``'s message was returned to its queue before (kombu's restore marks it
    in its ``delivery_info`` and headers: a lapsed lease, a give-back, a shutdown)."""
    info = getattr(req, "delivery_info", None) or {}
    if info.get("redelivered"):
        return True
    headers = getattr(getattr(req, "message", None), "headers", None) or {}
    return bool(headers.get("redelivered"))


def suspect_bucket(bucket: str, task_id: str) -> str:
    """The bucket of a suspect: its own, so no batch-mate joins it."""
    return f"{bucket}#suspect-{task_id}"


class Deliveries:
    """One worker's poison accounting over ``counters``.

    Args:
        counters: the blame records (:class:`InFlight`).
        max_deliveries: deaths after which a message is refused (``WORKER_LOST``).
    """

    def __init__(self, counters: Counters, max_deliveries: int = MAX_DELIVERIES) -> None:
        self.counters = counters
        self.max_deliveries = max_deliveries

    def arrive(
        self, task_ids: Sequence[str], redelivered: Sequence[bool] | None = None
    ) -> list[int]:
        """Record the arrival group as being decoded; each one's deliveries so far with its
        worker's death, this one included (1 + deaths; 0: not known). ``redelivered``: per
        id, whether its message was marked redelivered (``None``: not known; all are)."""
        try:
            return self.counters.arrive(task_ids, redelivered)
        except Exception:  # Redis away: not suspects; their batch's record names them
            log.warning("could not record %d arrivals", len(task_ids), exc_info=True)
            return [0] * len(task_ids)

    def decoded(self, task_ids: Sequence[str]) -> None:
        """These decoded without dying: waiting in the window is no fault of theirs (a
        worker that dies now was not killed by them); their batch's record names them again."""
        try:
            self.counters.uncount(task_ids)
        except Exception:
            log.warning("could not unrecord %d decoded arrivals", len(task_ids), exc_info=True)

    def refusal(self, task_id: str, count: int) -> WorkerLost | None:
        """The error that refuses a delivery counted ``count`` times (this one included),
        or ``None`` if it may run."""
        deaths = count - 1
        if deaths >= self.max_deliveries:
            return WorkerLost(
                f"its worker was lost {deaths} times while running it; not retried again"
            )
        if deaths > 0:
            log.info("redelivered id=%s died_in_flight=%d", task_id, deaths)
        return None

    @staticmethod
    def suspect(count: int) -> bool:
        """Whether a delivery counted ``count`` times (this one included) had a worker die
        with it before: it then runs alone, in a bucket of its own."""
        return count > 1

    @classmethod
    def bucket(cls, bucket: str, task_id: str, count: int) -> str:
        """The bucket a delivery counted ``count`` times runs in."""
        return suspect_bucket(bucket, task_id) if cls.suspect(count) else bucket

    def begin(self, batch: list[Work]) -> tuple[list[Work], list[Work]]:
        """Split ``batch`` into (to run, duplicates with a final result already); the calling
        lane's record names the members to run."""
        try:
            states = self.counters.begin([w.req.id for w in batch])
        except Exception:  # a safety net: run anyway (result writes are first-wins)
            log.warning("could not check or record a batch", exc_info=True)
            return batch, []
        run, dups = [], []
        for w, st in zip(batch, states, strict=True):
            if st == FINAL:
                dups.append(w)
            else:
                w.counted = w.counted or st > 0
                run.append(w)
        return run, dups

    def release(self, works: Sequence[Work]) -> None:
        """Take requests that did not die (a shutdown, returned unrun) out of the records."""
        with contextlib.suppress(Exception):
            self.counters.uncount([w.req.id for w in works])

    def retire(self) -> None:
        """The worker stopped gracefully: nothing it held is to blame (its records go)."""
        try:
            self.counters.retire()
        except Exception:  # they expire with their TTL; only redelivered copies look them up
            log.warning("could not remove this worker's blame records", exc_info=True)


class Isolation:
    """Who may run beside whom, so that a worker's death is blamed only on what caused it.

    A *suspect* batch (a delivery whose worker died before) runs alone: it waits until no
    other batch runs and no arrival group is in the decode record (decoding), and
    while it waits or runs no other batch starts and arrivals are not recorded. Other
    batches run beside each other and beside decoding arrivals (a first death may blame a
    decoding request once; its redelivery is then a suspect and runs alone).

    Batch threads block here; the consumer's event loop never does: :meth:`try_admit`
    answers at once, and ``on_clear`` (any thread) is called once the last suspect ends so
    that the deferred arrivals are admitted then.
    """

    def __init__(self, on_clear: Callable[[], None] | None = None) -> None:
        self.on_clear = on_clear or (lambda: None)
        self._cond = threading.Condition()
        self._batches = 0  # other batches running
        self._admitting = 0  # arrival groups recorded, not yet out of the decode record
        self._suspects = 0  # suspects running or waiting to
        self._suspect_running = False

    def try_admit(self, block: bool = False) -> bool:
        """Start recording an arrival group; ``False`` (when not ``block``) while a suspect
        runs or waits: record it once :attr:`on_clear` is called."""
        with self._cond:
            if self._suspects and not block:
                return False
            self._cond.wait_for(lambda: not self._suspects)
            self._admitting += 1
            return True

    def admitted(self) -> None:
        """The group started by :meth:`try_admit` left the decode record (or failed to)."""
        with self._cond:
            self._admitting -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def running(self, suspect: bool) -> Iterator[None]:
        """Hold while a batch runs (batch threads); a suspect one runs alone."""
        with self._cond:
            if suspect:
                self._suspects += 1
                self._cond.wait_for(
                    lambda: not (self._batches or self._admitting or self._suspect_running)
                )
                self._suspect_running = True
            else:
                self._cond.wait_for(lambda: not self._suspects)
                self._batches += 1
        clear = False
        try:
            yield
        finally:
            with self._cond:
                if suspect:
                    self._suspects -= 1
                    self._suspect_running = False
                    clear = not self._suspects
                else:
                    self._batches -= 1
                self._cond.notify_all()
            if clear:
                self.on_clear()

    def snapshot(self) -> dict[str, int]:
        """Counts now (for tests and stats)."""
        with self._cond:
            return {
                "batches": self._batches,
                "admitting": self._admitting,
                "suspects": self._suspects,
            }
