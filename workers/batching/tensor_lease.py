"""Renewing the leases of input segments bound to requests (``shared.transport.lifetime``).

A video a producer put in /dev/shm for one request lives while that request may still run:

- :class:`SegmentRenewer`, the janitor's (every worker process, ``workers.janitor``): before
  each collection, the bound segments of the host whose lease ends within two janitor
  intervals and whose request has no final result yet are renewed. One pipelined ``EXISTS
  fleet:final:<id>`` per such request, as the worker's Redis user (it may read every key);
  only segments near the end of a lease are looked up, about once per TTL each.
- :func:`renew_inputs`, the engine's, when it takes a request: that request's own inputs,
  before they are mapped (a host where no worker ran while the request waited renewed
  nothing, and collected nothing either).

An operator's collection (:meth:`SegmentRenewer.collect`: ``fleet shm gc``, and ``fleet down``
before it stops Redis) asks about every bound segment of the host: those whose request is final
go at once, lapsed leases go, and only inputs of requests Redis says are not final are renewed
(an unknown answer renews nothing: after ``fleet down`` no Redis can answer, and renewing
then would only keep finished requests' inputs another lease).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared import schema
from shared.errors import FleetError
from shared.tensor_wire import SHM, find_wires
from shared.transport import lifetime

if TYPE_CHECKING:
    import redis

    from shared.settings import Settings
    from shared.transport import ShmStore

log = logging.getLogger("fleet.tensor_lease")

_MAX_DEPTH = 8  # inputs are small JSON objects; refs sit one or two levels down


def segment_path(store: ShmStore, seg_id: str) -> Path:
    """The file of segment ``seg_id`` in ``store`` (ids are validated: never a path).

    Raises:
        TensorRefError: a malformed id.
    """
    from shared.transport.root import segment_path as path_in

    return path_in(store.root, seg_id)


class SegmentRenewer:
    """Renews the leases of a store's bound segments whose requests may still run.

    Args:
        settings: fleet settings (the worker's Redis credentials).
        interval_s: the janitor's interval; leases ending within
            ``lifetime.RENEW_MARGIN_INTERVALS`` of them are renewed.
        client: a Redis client to read final markers with (default: one of its own, as the
            ``role`` user, made on first need: a host without bound segments never connects).
        role: the Redis ACL user of that client (``fleet shm gc`` runs as ``operator``).
    """

    def __init__(
        self,
        settings: Settings,
        interval_s: float,
        client: redis.Redis | None = None,
        role: str = "worker",
    ) -> None:
        self.settings = settings
        self.role = role
        self.margin_s = lifetime.RENEW_MARGIN_INTERVALS * float(interval_s)
        self._client = client
        self.renewed = 0  # renewals so far
        self.unknown = 0  # lookups Redis could not answer (a janitor renews them anyway)
        self.cause: str | None = None  # why the last lookup Redis could not answer failed

    def client(self) -> redis.Redis:
        if self._client is None:
            from shared.redis_client import redis_client

            self._client = redis_client(
                self.settings, self.role, socket_timeout=5.0, socket_connect_timeout=2.0
            )
        return self._client

    def close(self) -> None:
        """Close the Redis client it made (a later lookup makes another)."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def finals(self, requests: list[str]) -> dict[str, bool | None]:
        """Request id -> whether it has its final result; None for each when Redis cannot
        tell (unreachable, refused, no credentials)."""
        try:
            with self.client().pipeline(transaction=False) as pipe:
                for r in requests:
                    pipe.exists(schema.final_key(r))
                found = pipe.execute()
        except Exception as exc:  # any failure: renew rather than lose the request's input
            self.unknown += len(requests)
            self.cause = f"{type(exc).__name__}: {exc}"
            log.warning("cannot tell whether %d requests are final (%s)", len(requests), exc)
            return dict.fromkeys(requests)
        self.cause = None
        return {r: bool(n) for r, n in zip(requests, found, strict=True)}

    def renew_due(self, store: ShmStore, now: float | None = None) -> list[str]:
        """Renew every bound segment of ``store`` due at ``now`` (default: the time now)
        whose request is not final; returns their ids.

        Raises:
            TransportError: the store's directory cannot be listed.
        """
        now = time.time() if now is None else now
        due = lifetime.due(store.ls(), now, self.margin_s, store.max_lifetime_s)
        if not due:
            return []
        final = self.finals(sorted({s.request for s in due}))
        renewed = [
            s.id
            for s in lifetime.still_running(due, final)
            if lifetime.renew(segment_path(store, s.id), now)
        ]
        self.renewed += len(renewed)
        return renewed

    def collect(self, store: ShmStore, now: float | None = None, renew: bool = True) -> Collected:
        """An operator's collection of ``store`` at ``now`` (``fleet shm gc``; ``fleet down``
        with ``renew=False``): every bound segment's request is looked up; with ``renew``,
        the due inputs of requests Redis says are not final are renewed
        (:func:`~shared.transport.lifetime.renewable`); then ``gc`` removes what is stale and
        the inputs of final requests, whatever their lease.

        Raises:
            TransportError: the store's directory cannot be listed.
        """
        now = time.time() if now is None else now
        segments = store.ls()
        requests = sorted({s.request for s in segments if s.request})
        final = self.finals(requests) if requests else {}
        renewed: list[str] = []
        if renew:
            due = lifetime.renewable(segments, final, now, self.margin_s, store.max_lifetime_s)
            renewed = [s.id for s in due if lifetime.renew(segment_path(store, s.id), now)]
            self.renewed += len(renewed)
        done = lifetime.finished(final)
        removed = store.gc(now, finished=done)
        gone = set(removed)
        return Collected(
            removed=removed,
            finished=[s.id for s in segments if s.request in done and s.id in gone],
            renewed=renewed,
            final=final,
            cause=self.cause if any(v is None for v in final.values()) else None,
        )


@dataclass(frozen=True)
class Collected:
    """What :meth:`SegmentRenewer.collect` did.

    Attributes:
        removed: what ``gc`` removed (segment ids, temp and pool file names).
        finished: the removed segments that were inputs of final requests.
        renewed: the segments renewed (their requests are not final).
        final: request id -> final (True), not final (False), Redis could not tell (None).
        cause: why Redis could not tell, when it could not.
    """

    removed: list[str]
    finished: list[str] = field(default_factory=list)
    renewed: list[str] = field(default_factory=list)
    final: Mapping[str, bool | None] = field(default_factory=dict)
    cause: str | None = None


def _claims_shm(obj: Mapping[str, Any]) -> bool:
    # Loose on purpose: the lease is renewed first, the adapter then validates the ref.
    return obj.get("kind") == SHM and isinstance(obj.get("id"), str)


def shm_ref_ids(inputs: Any) -> Iterator[str]:
    """The segment ids of the ``{"kind": "shm", "id": ...}`` objects in a request's inputs."""
    for ref in find_wires(inputs, _claims_shm, max_depth=_MAX_DEPTH):
        yield ref["id"]


def renew_inputs(
    store: Callable[[], ShmStore], inputs: Any, request_id: str, now: float | None = None
) -> list[str]:
    """Renew the input segments of ``inputs`` that are bound to ``request_id`` (the request
    this worker just took), lapsed leases included while their files exist; returns their
    ids. Segments bound to another request, or to none, are left alone; a bad or unknown ref
    is left to the adapter, which refuses it with its code.

    Args:
        store: returns the worker's store (called only when the inputs carry a ref).
    """
    ids = list(shm_ref_ids(inputs))
    if not ids:
        return []
    now = time.time() if now is None else now
    renewed = []
    try:
        s = store()
        for seg_id in ids:
            try:
                info = s.info(seg_id)
            except FleetError:
                continue
            if (
                info.request == request_id
                and lifetime.extends(info, now, s.max_lifetime_s)
                and lifetime.renew(segment_path(s, seg_id), now)
            ):
                renewed.append(seg_id)
    except (FleetError, OSError) as exc:
        log.warning("could not renew the inputs of %s: %s", request_id, exc)
    return renewed
