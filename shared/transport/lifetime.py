"""The lifetime of a segment bound to a request: a lease renewed while the request may run.

A producer writes a video into /dev/shm before its request is queued, and the request may then
wait in a backlog for longer than any fixed TTL (a BULK request has no deadline). So a segment
written for one request names it in its metadata (``mmfleet.request``: the Celery task id,
:meth:`ShmStore.put`'s ``request_id``), and its TTL counts from its last renewal instead of
from its write::

    expires_at = max(created_at + ttl_s, min(renewed_at + ttl_s, created_at + max_lifetime_s))

``renewed_at`` is the file's mtime: set by the write, then to "now" by every renewal
(:func:`renew`, ``futimens``). Like the metadata it lives in the file, which only the fleet's
uid can change: a ref (a message) cannot extend a segment's life, and no renewal reaches past
``max_lifetime_s`` (``[transport] max_ref_lifetime_s``), so a segment whose request never
ends (its producer died before sending it, its queue was purged) still goes. A segment bound
to no request keeps ``created_at + ttl_s``.

Who renews (``workers.batching.tensor_lease``):

- every worker's janitor, before it collects: the bound segments of its host whose lease ends
  within :data:`RENEW_MARGIN_INTERVALS` janitor intervals and whose request has no final
  result yet (``fleet:final:<id>`` absent; when Redis cannot tell, it renews: the cap bounds
  that). Renewing that far ahead means no collection, in any process, sees a live request's
  lease lapse; the settings refuse a TTL under ``MIN_TTL_JANITOR_INTERVALS`` (3) janitor
  intervals. ``fleet shm gc`` renews those of requests Redis says are not final (see below).
- the worker that takes a request renews that request's own inputs before it maps them: on a
  host where no worker ran while the request waited, nobody renewed them (nobody collected
  them either). A lapsed lease is renewed too, as long as the file is still there.

Once its request is final a segment is renewed no more and lives out its last lease, unless
its producer releases it first (``ResultHandle.get`` and the gateway's result read do) or an
operator collects it: ``fleet shm gc`` and ``fleet down`` (before it stops Redis) remove the
segments whose requests are final (:func:`finished`) and those whose lease lapsed, and renew
none whose request Redis could not tell final or not (:func:`renewable`).
"""

from __future__ import annotations

import errno
import math
import os
import re
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol, TypeVar

__all__ = [
    "RENEW_MARGIN_INTERVALS",
    "REQUEST_ID_PATTERN",
    "Lease",
    "due",
    "expires_at",
    "extends",
    "finished",
    "renew",
    "renewable",
    "still_running",
    "validate_request_id",
]

REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
"""A request (Celery task) id a segment may be bound to: what the gateway accepts as an id."""

RENEW_MARGIN_INTERVALS = 2.0
"""A janitor renews a lease that ends within this many of its intervals."""


def validate_request_id(request_id: str) -> str:
    """``request_id`` if it is a valid id to bind a segment to.

    Raises:
        ValueError: not 1-128 characters of ``[A-Za-z0-9._:-]`` starting alphanumeric.
    """
    if not isinstance(request_id, str) or REQUEST_ID_PATTERN.fullmatch(request_id) is None:
        raise ValueError(f"request_id must match {REQUEST_ID_PATTERN.pattern}, got {request_id!r}")
    return request_id


def expires_at(
    created_at: float, ttl_s: float, renewed_at: float, max_lifetime_s: float, bound: bool
) -> float:
    """When a segment expires, in epoch seconds (see the module docstring).

    Args:
        created_at: the segment's write time (metadata), epoch seconds.
        ttl_s: its TTL (metadata), seconds.
        renewed_at: its last renewal (the file's mtime), epoch seconds.
        max_lifetime_s: no renewal reaches past ``created_at`` plus this, seconds.
        bound: the segment is bound to a request (only those are renewed).
    """
    base = created_at + ttl_s
    if not bound:
        return base
    return max(base, min(renewed_at + ttl_s, created_at + max_lifetime_s))


class Lease(Protocol):
    """What a renewal decision reads of a segment (``shared.transport.SegmentInfo``)."""

    @property
    def request(self) -> str: ...
    @property
    def created_at(self) -> float: ...
    @property
    def ttl_s(self) -> float: ...
    @property
    def expires_at(self) -> float: ...


L = TypeVar("L", bound=Lease)


def extends(seg: Lease, now: float, max_lifetime_s: float) -> bool:
    """Whether renewing ``seg`` at ``now`` would move its expiry later (False for a segment
    bound to no request, and for one whose lease already reaches the cap)."""
    if not seg.request:
        return False
    renewed = expires_at(seg.created_at, seg.ttl_s, now, max_lifetime_s, bound=True)
    return renewed > seg.expires_at


def due(segments: Iterable[L], now: float, margin_s: float, max_lifetime_s: float) -> list[L]:
    """The bound segments a janitor should renew at ``now``: their lease ends within
    ``margin_s`` seconds (or ended: nobody collected them yet) and renewing extends it."""
    return [
        s for s in segments if s.expires_at - now < margin_s and extends(s, now, max_lifetime_s)
    ]


def still_running(segments: Iterable[L], final: Mapping[str, bool | None]) -> list[L]:
    """Those of ``segments`` whose request may still run: not known to be final.

    Args:
        final: request id -> True (it has its final result), False (not yet), or None (Redis
            could not tell: counted as running; the lifetime cap bounds the cost of a wrong
            guess, and letting a queued request's input lapse would fail the request).
    """
    return [s for s in segments if final.get(s.request) is not True]


def finished(final: Mapping[str, bool | None]) -> set[str]:
    """The request ids of ``final`` known to have their final result (True): their inputs
    may go now (``fleet shm gc``, ``fleet down``)."""
    return {r for r, done in final.items() if done is True}


def renewable(
    segments: Iterable[L],
    final: Mapping[str, bool | None],
    now: float,
    margin_s: float,
    max_lifetime_s: float,
) -> list[L]:
    """The segments an operator's collection (``fleet shm gc``) renews at ``now``: due
    (:func:`due`), their lease not lapsed yet, and their request known not to be final
    (False). Unlike a janitor's, an unknown answer (None: Redis could not tell, e.g. the
    stack is down) renews nothing, and a lapsed lease is left to lapse."""
    return [
        s for s in due(segments, now, margin_s, max_lifetime_s)
        if s.expires_at > now and final.get(s.request) is False
    ]  # fmt: skip


def renew(path: Path, now: float) -> bool:
    """Stamp ``now`` as the last renewal of the segment file at ``path`` (its mtime).

    Returns:
        True if renewed; False if the file is gone (released or collected meanwhile) or is
        not a regular file of this uid (never followed, never renewed).

    Raises:
        OSError: any other failure (a full table of descriptors, ...).
    """
    if not math.isfinite(now):
        raise ValueError(f"now must be finite, got {now}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except (FileNotFoundError, IsADirectoryError):
        return False
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink
            return False
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_nlink == 0:
            return False
        os.utime(fd, (now, now))  # futimens: the file's owner may set any time
    finally:
        os.close(fd)
    return True
