"""Weighted fair share between tenants inside one priority class: start-time fair queuing
(SFQ; Goyal, Vin and Cheng 1996) over the requests held in a worker's prefetch window.

Each held request gets a virtual start tag when it enters the window::

    start  = max(V[class], finish[class, tenant])
    finish[class, tenant] = start + 1 / weight[tenant]

and ``V[class]``, the class's virtual time, is the largest start tag of the requests of that
class dispatched so far. The batcher (``workers.batching.batcher``) orders held requests by
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

from collections.abc import Iterable, Mapping
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

    def served(self, batch: Iterable[Any]) -> None:
        """``batch`` was dispatched: its classes' virtual times advance."""
        virtual = self._virtual
        for p in batch:
            cls = int(p.priority)
            if p.vstart > virtual.get(cls, 0.0):
                virtual[cls] = p.vstart

    @staticmethod
    def key(p: Any) -> tuple[int, float, int]:
        """The fair order: class first, then start tag, then arrival."""
        return (int(p.priority), p.vstart, p.seq)
