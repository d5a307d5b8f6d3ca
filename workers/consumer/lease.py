"""Leases on the messages a batching worker holds, kept inside kombu's own structures.

kombu's Redis transport records every delivered message in the ``unacked`` hash and scores
its delivery tag in ``unacked_index`` with the delivery time; any consumer's periodic
``restore_visible`` scan pushes an entry older than the visibility timeout back onto its
queue (at its priority). With a one-hour timeout a dead worker's work waits an hour; with a
short one a live worker's long batch is handed to another worker while it still runs.

A :class:`LeaseKeeper` turns that timeout into a lease: a thread of its own re-scores every
tag this process holds to "now" (one ``ZADD XX`` for the whole window) every
``lease_renew_s``, and batching workers run kombu's scan with ``lease_expiry_s`` as the
visibility timeout. A live worker's entries never age past it; a dead (or stopped) worker's
stop being renewed and come back within ``lease_s``, taken by any live worker.

The keeper also acks and gives back messages on a Redis connection of its own, so both work
from any thread and after the kombu channel that delivered them is gone (a connection loss
closes it while the engine still runs what it delivered): ``ack`` removes the entries
(kombu's ``ZREM`` + ``HDEL``), ``give_back`` back-dates them so the next scan, by any
worker, returns them at once.

Keys: ``shared.schema.UNACKED_KEY`` and ``UNACKED_INDEX_KEY`` (kombu's defaults; the fleet
sets no ``global_keyprefix``).

Acks: a batch's messages in one Redis round trip, whatever channel delivered them. kombu's Redis
transport acks one message per round trip (``QoS.ack``: ZREM from the unacked index + HDEL from the
unacked hash, in a pipeline of its own) on the channel that delivered it. :func:`ack_batch` sends
the same ZREM + HDEL for every message in one pipeline on the lease keeper's own connection, so it
works from any thread and after the delivering channel was closed by a connection loss; then it does
the bookkeeping kombu and Celery do after an ack (the channel's QoS forgets the delivery tag and
frees its prefetch slot, the message's state becomes ``ACK``, the request is marked acknowledged),
so the outcome is exactly that of ``Request.acknowledge()`` for each.

A settled group with results to store goes further: :func:`plan_acks` prepares the same acks
and the result writer sends them inside its script call, after the results
(``workers.batching.results_write_first.lua``), so storing and acking cost one round trip;
:meth:`AckPlan.finish` then does the bookkeeping.

Anything it does not recognise (no lease keeper, another transport, a message acked
already, a ``no_ack`` consumer) goes through ``Request.acknowledge()`` unchanged.

:func:`give_back` is the other way out of the window: messages returned to their queues at
once, unrun (shutdown, or results and acks Redis kept refusing).

Private kombu/Celery names (read from kombu 5.7.0; ``tests/unit/test_private_names.py``):
    kombu.message.Message: _state
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis
from celery.worker import state as worker_state
from kombu.transport import redis as kombu_redis
from kombu.transport.virtual import QoS as VirtualQoS

from shared import schema
from shared.clock import RedisClock
from shared.settings import Settings
from workers.batching.refusals import REFUSALS, reason_of

# what a tenant's max_queued releases with the acks: (task id, kwargs) each -> commands
Release = Callable[[list[tuple[str, Any]]], Sequence[tuple[Any, ...]]]

if TYPE_CHECKING:
    from shared.tracing import Tracing


log = logging.getLogger("fleet.lease")


_RENEW_CHUNK = 1024  # members per ZADD: one round trip for any realistic window


class LeaseKeeper:
    """Holds, renews, acks and gives back delivery tags of this process.

    Args:
        client: a Redis client of the keeper's own (thread-safe connection pool).
        renew_s: seconds between renewals.
        clock: Redis' clock (``shared.clock``), which every score is on, so that a host
            whose wall clock is off neither loses its leases nor takes others' for lapsed;
            the renewal thread keeps it sampled. Default: one reading ``client``'s ``TIME``.

    Thread safety: every method may be called from any thread.
    """

    def __init__(
        self, client: redis.Redis, renew_s: float, clock: RedisClock | None = None
    ) -> None:
        self.client = client
        self.renew_s = renew_s
        self.clock = clock if clock is not None else RedisClock(client.time)
        self._tags: dict[str, int] = {}  # tag -> holds (a tag delivered twice is held twice)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.renewals = 0
        self.renew_failures = 0
        self.last_renew_ms = 0.0
        # (sorted sets, node name) once announced: the modality's and each served model's
        self._live: tuple[tuple[str, ...], str] | None = None

    # -- holding ------------------------------------------------------------------------
    def hold(self, tag: str) -> None:
        """Start renewing ``tag`` (a message this process was just given)."""
        with self._lock:
            self._tags[tag] = self._tags.get(tag, 0) + 1

    def release(self, tags: Iterable[str]) -> None:
        """Stop renewing ``tags`` (acked, rejected or restored by kombu)."""
        with self._lock:
            for tag in tags:
                n = self._tags.get(tag, 0) - 1
                if n > 0:
                    self._tags[tag] = n
                else:
                    self._tags.pop(tag, None)

    def held(self) -> list[str]:
        with self._lock:
            return list(self._tags)

    def __len__(self) -> int:
        return len(self._tags)

    # -- Redis --------------------------------------------------------------------------
    def renew(self) -> int:
        """Re-score every held tag to now; returns how many entries still existed.

        Raises:
            redis.RedisError: Redis is unreachable (the thread retries next period).
        """
        tags = self.held()
        now = self.clock.now()  # Redis' time; samples it when due (this thread keeps it)
        if not tags:
            return 0
        t0 = time.perf_counter()
        kept = 0
        with self.client.pipeline(transaction=False) as pipe:
            for i in range(0, len(tags), _RENEW_CHUNK):
                chunk = tags[i : i + _RENEW_CHUNK]
                # XX: never re-create an entry acked or restored meanwhile; CH counts changes.
                pipe.zadd(schema.UNACKED_INDEX_KEY, dict.fromkeys(chunk, now), xx=True, ch=True)
            kept = sum(int(n) for n in pipe.execute())
        self.last_renew_ms = (time.perf_counter() - t0) * 1000.0
        self.renewals += 1
        return kept

    def ack(self, tags: list[str], also: Sequence[tuple[Any, ...]] = ()) -> None:
        """Remove ``tags``' unacked entries (kombu's ack) in one round trip, then release them.
        ``also``: commands applied with the ack, atomically (``MULTI``/``EXEC``): a tenant's
        ``max_queued`` release (``shared.tenant_quota``).

        Raises:
            redis.RedisError: the entries are still there (the caller retries or gives up;
                the tags stay held, so the messages are not returned meanwhile).
        """
        if not tags:
            return
        with self.client.pipeline(transaction=bool(also)) as pipe:
            for command in also:
                pipe.execute_command(*command)
            pipe.zrem(schema.UNACKED_INDEX_KEY, *tags)
            pipe.hdel(schema.UNACKED_KEY, *tags)
            pipe.execute()
        self.release(tags)

    def give_back(self, tags: list[str]) -> None:
        """Return ``tags``' messages to their queues at once (the next scan restores them).

        Their index scores are set to 0, older than any visibility timeout; kombu's
        ``restore_visible`` (in this worker or any other) then pushes each back at its
        priority and marks it redelivered. Released whether or not Redis answered: a lapsed
        lease returns them anyway.
        """
        if not tags:
            return
        try:
            self.client.zadd(schema.UNACKED_INDEX_KEY, dict.fromkeys(tags, 0), xx=True)
        except redis.RedisError:
            log.warning("could not give back %d messages; their leases lapse", len(tags))
        self.release(tags)

    # -- liveness -----------------------------------------------------------------------
    def announce(
        self, modality: str, node: str, models: Sequence[str] = (), default: bool = True
    ) -> None:
        """Report ``node`` live for ``modality`` (``default``: it consumes the modality's own
        queue, its default model's) and for each of ``models`` (the ``[models.<name>]``
        tables it serves) with every renewal, from now on (call it once the worker is ready:
        producers take a live worker to mean requests will run)."""
        keys = (
            *((schema.live_key(modality),) if default else ()),
            *(schema.live_key(modality, m) for m in models),
        )
        self._live = (keys, node)
        self.heartbeat()

    def heartbeat(self) -> None:
        """Score this node "now" in its modality's liveness set and drop members silent for
        a long time (a SIGKILLed worker never removes itself).

        Raises:
            redis.RedisError: Redis is unreachable.
        """
        if self._live is None:
            return
        keys, node = self._live
        now = self.clock.now()  # Redis' time: producers compare it with Redis' time
        with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.zadd(key, {node: now})
                pipe.zremrangebyscore(key, "-inf", now - schema.LIVE_FORGET_S)
            pipe.execute()

    def _withdraw(self) -> None:
        if self._live is not None:
            keys, node = self._live
            for key in keys:
                try:
                    self.client.zrem(key, node)
                except redis.RedisError:
                    log.warning("could not withdraw %s from %s; it ages out", node, key)

    # -- the renewal thread -------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fleet-lease", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop renewing (what is still held then lapses unless acked or given back) and
        withdraw this node from its liveness set."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self._withdraw()

    def _run(self) -> None:
        wait = self.renew_s
        while not self._stop.wait(wait):
            wait = self.renew_s
            wrote = bool(self._tags) or self._live is not None  # else nothing is written
            try:
                self.renew()
                self.heartbeat()
            except redis.RedisError as exc:
                self.renew_failures += 1
                reason = reason_of(exc)
                if reason is None:
                    log.warning("lease renewal failed (%s); retrying in %.1f s", exc, self.renew_s)
                    continue
                # Redis refuses writes (reported once, by workers.batching.refusals): retried
                # sooner than a renewal period, so the leases are renewed within about a
                # second of Redis accepting writes again; restore scans wait longer than that.
                wait = min(self.renew_s, REFUSALS.refused("lease", reason, exc))
            except Exception:  # never let the renewals stop silently
                self.renew_failures += 1
                log.exception("lease renewal crashed; retrying")
            else:
                if wrote:
                    REFUSALS.accepted("lease")

    def snapshot(self) -> dict[str, float | int]:
        return {
            "held": len(self),
            "renewals": self.renewals,
            "renew_failures": self.renew_failures,
            "last_renew_ms": round(self.last_renew_ms, 3),
        }


_keeper: LeaseKeeper | None = None


def install(keeper: LeaseKeeper | None) -> None:
    """Make ``keeper`` this process's (the broker's QoS reports deliveries to it)."""
    global _keeper
    _keeper = keeper


def current() -> LeaseKeeper | None:
    """This process's keeper, or ``None`` (a producer, a baseline worker)."""
    return _keeper


def lease_transport_options(settings: Settings) -> dict[str, Any]:
    """kombu transport options that make its restore scan honour leases.

    ``visibility_timeout`` becomes the lease's expiry, the scan runs every
    ``lease_scan_s`` and kombu's restore mutex expires with the lease (kombu's default, 300
    s, would stall every restore for five minutes after a worker died holding it).
    """
    r = settings.redis
    return {
        "visibility_timeout": r.lease_expiry_s,
        "unacked_restore_interval": r.lease_scan_s,
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": max(1, math.ceil(r.lease_s)),
    }


@dataclass(slots=True)
class AckPlan:
    """The acks of a group of requests, prepared (:func:`plan_acks`): what Redis must remove
    (``tags`` and the ``also`` commands, sent by :meth:`LeaseKeeper.ack` or inside the result
    script, ``workers.batching.results_write_first.lua``), then :meth:`finish` does the
    bookkeeping kombu and Celery do after an ack.

    Attributes:
        tags: the delivery tags whose unacked entries go (kombu's ZREM + HDEL).
        also: commands applied with them (a tenant's ``max_queued`` release), each
            ``(name, key, *args)``.
        keeper: the lease keeper that holds ``tags`` (released by :meth:`finish`).
        items: the ``(request, message)`` acked through the tags.
        single: requests acked one by one (``Request.acknowledge()``) by :meth:`finish`.
    """

    tags: list[str]
    also: Sequence[tuple[Any, ...]]
    keeper: LeaseKeeper | None
    items: list[tuple[Any, Any]]
    single: list[Any]

    def finish(self, release: bool = True) -> int:
        """Once Redis removed ``tags`` (and applied ``also``): the keeper stops renewing them
        (``release``: not done yet, as :meth:`LeaseKeeper.ack` does), the channel's QoS
        forgets each delivery tag and frees its prefetch slot, the message's state becomes
        ``ACK``, the request is marked acknowledged; the others are acked one by one.
        Returns how many were acked through the shared round trip."""
        finished: list[str] = []
        try:
            for req, msg in self.items:
                VirtualQoS.ack(msg.channel.qos, msg.delivery_tag)
                msg._state = "ACK"
                req.acknowledged = True
                finished.append(msg.delivery_tag)
        finally:  # what raised is acked again by the caller's retry, which releases it then
            if release and self.keeper is not None and finished:
                self.keeper.release(finished)
        for req in self.single:
            req.acknowledge()
        return len(self.items)


def plan_acks(
    requests: Iterable[Any],
    keeper: LeaseKeeper | None = None,
    release: Release | None = None,
) -> AckPlan:
    """Prepare the acks of Celery requests (see :func:`ack_batch`); nothing is sent.

    Args:
        requests: ``celery.worker.request.Request`` objects whose results are stored.
        keeper: the process's lease keeper (``workers.consumer.lease.current()`` if ``None``).
        release: given each acked request's ``(task id, kwargs)``, the commands applied with
            the acks (``shared.tenant_quota.release_commands``); ``None``: no tenant has a
            ``max_queued``.
    """
    keeper = keeper if keeper is not None else current()
    items: list[tuple[Any, Any]] = []
    single: list[Any] = []
    for req in requests:
        if req.acknowledged:
            continue
        msg = getattr(req, "message", None)
        qos = getattr(getattr(msg, "channel", None), "qos", None)
        if (
            keeper is None
            or not isinstance(qos, kombu_redis.QoS)
            or msg.acknowledged
            or _no_ack(msg)
        ):
            single.append(req)
            continue
        items.append((req, msg))
    also = release([(req.id, req.kwargs) for req, _ in items]) if release and items else ()
    tags = [msg.delivery_tag for _, msg in items]
    return AckPlan(tags, also, keeper, items, single)


def ack_batch(
    requests: Iterable[Any],
    keeper: LeaseKeeper | None = None,
    release: Release | None = None,
) -> int:
    """Acknowledge Celery requests in one pipeline (:func:`plan_acks`, then
    :meth:`LeaseKeeper.ack`, then :meth:`AckPlan.finish`); the arguments are
    :func:`plan_acks`'s.

    Returns:
        How many were acked through the shared pipeline (the rest went one by one).

    Raises:
        redis.RedisError: the shared pipeline failed; none of its messages is acked (the
            caller retries; their leases are still held, so they are not returned).
    """
    plan = plan_acks(requests, keeper, release)
    if plan.tags and plan.keeper is not None:
        plan.keeper.ack(plan.tags, plan.also)  # releases them
    return plan.finish(release=False)


def _no_ack(msg: Any) -> bool:
    consumers = getattr(msg.channel, "no_ack_consumers", None)
    tag = (msg.delivery_info or {}).get("consumer_tag")
    return bool(consumers) and tag in consumers


def give_back(reqs: Iterable[Any], keeper: LeaseKeeper | None, tracing: Tracing) -> int:
    """Return messages to their queues at once, unrun (their prefetch slots are freed).

    Args:
        reqs: ``celery.worker.request.Request`` objects held by this worker; those acked
            already are skipped.
        keeper: the lease keeper that moves them back (``None``: nothing moves them; their
            visibility timeout will).
        tracing: ends each request's span with ``outcome="given_back"``.

    Returns:
        How many were given back (the engine's ``given_back`` counter).
    """
    reqs = list(reqs)
    tags = [r.message.delivery_tag for r in reqs if not r.acknowledged]
    if keeper is not None:
        keeper.give_back(tags)
    for r in reqs:
        if r.acknowledged:
            continue
        qos = getattr(r.message.channel, "qos", None)
        if qos is not None:
            VirtualQoS.ack(qos, r.message.delivery_tag)  # forget it: frees the slot
        r.acknowledged = True  # nothing may ack it any more: another worker owns it
        worker_state.task_ready(r)
        tracing.finished(r, None, outcome="given_back")
    return len(tags)
