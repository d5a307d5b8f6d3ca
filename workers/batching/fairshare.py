"""Weighted fair share between tenants inside one priority class: start-time fair queuing
(SFQ; Goyal, Vin and Cheng 1996) over the requests held in a worker's prefetch window.

Each held request gets a virtual start tag when it enters the window::

    start  = max(V[class], finish[class, tenant])
    finish[class, tenant] = start + 1 / weight[tenant]

and ``V[class]``, the class's virtual time, is the start tag of the last batch's head (its
smallest tag: the request whose turn it was). A batch holds its head and the requests of the
head's length bucket, by tag, and those may carry tags far ahead of the head's (a backlog's
requests of that bucket, up to a window's worth): they ride along out of their turn and do
not move the virtual time. If they did, it would jump to the backlog's newest tags, and a
tenant arriving next would start behind the whole backlog held in the window (measured:
the late tenant's p99 about 1.5 times longer in the fairness bench's simulation). The price:
a tenant arriving starts at the head's tag, up to one batch of the incumbent's requests
ahead of where strict SFQ would put it.

The batcher (``workers.batching.batcher``) orders held requests by
``(priority class, start tag)`` instead of ``(priority class, arrival)``: classes keep their
strict order (REALTIME, HIGH, NORMAL, BULK) and deadlines their rules; within a class, the
tenants present take turns in proportion to their weights, whatever each one's backlog.
A tenant arriving behind another's backlog starts at the current virtual time, so its first
request is among the next ones served, not behind the backlog; a tenant that was idle earns
no credit for it (SFQ's fairness bound: a backlogged tenant waits behind at most about one
request of each other tenant per turn of its own).

Requests of one tenant keep their arrival order (their tags grow with it). With only one
tenant's requests held (every request without a tenant, the usual case), none of this runs:
the batcher's order is arrival's, as it always was.

Pure logic: no clock, no I/O; the batcher calls :meth:`FairShare.tag` on arrival and
:meth:`FairShare.served` on dispatch. Unit tests: ``tests/unit/test_fairshare.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["FairShare"]


class FairShare:
    """SFQ tags per priority class. ``weights``: tenant -> weight (others weigh 1);
    ``default``: the tenant of a request without one."""

    def __init__(self, weights: Mapping[str, float], default: str = "default") -> None:
        self.weights = dict(weights)
        self.default = default
        self._virtual: dict[int, float] = {}  # class -> V
        self._finish: dict[tuple[int, str], float] = {}  # (class, tenant) -> last finish tag

    def tenant(self, p: Any) -> str:
        """The tenant ``p`` (a ``Pending``) belongs to."""
        return p.tenant if p.tenant is not None else self.default

    def tag(self, p: Any) -> None:
        """Give ``p`` (a ``Pending``, arriving now) its start tag (``p.vstart``)."""
        cls = int(p.priority)
        name = self.tenant(p)
        start = max(self._virtual.get(cls, 0.0), self._finish.get((cls, name), 0.0))
        self._finish[(cls, name)] = start + 1.0 / self.weights.get(name, 1.0)
        p.vstart = start

    def retag(self, held: Iterable[Any]) -> None:
        """Tag ``held`` afresh, in their arrival order (fair share starting while they are
        held: the tenants' finish tags start again from the virtual time)."""
        self._finish.clear()
        for p in held:
            self.tag(p)

    def served(self, batch: Sequence[Any]) -> None:
        """``batch`` (its head first) was dispatched: the head's class's virtual time moves
        to the head's tag."""
        if batch:
            head = batch[0]
            cls = int(head.priority)
            if head.vstart > self._virtual.get(cls, 0.0):
                self._virtual[cls] = head.vstart

    @staticmethod
    def key(p: Any) -> tuple[int, float, int]:
        """The fair order: class first, then start tag, then arrival."""
        return (int(p.priority), p.vstart, p.seq)
