"""Which tenant's list a worker's take starts with: weighted turns between the lists of one
priority step (``shared.tenants``).

With ``[tenancy] share = "fair"``, each ``[tenants]`` tenant's messages wait in a list of
their own beside the priority list (which holds the default tenant's and every other
tenant's). The take script (``take_many.lua``) empties its keys in the order it is given,
up to the window's free slots; in that order the priority steps come first (priorities
unchanged), and within a step this module orders the tenants' lists for each take: the list
whose messages the window holds fewest of, for its weight, first (the window's deficit:
the channel records which list each message it holds came from, :meth:`TenantTurns.taken`,
and forgets those no longer held), ties broken by smooth weighted round robin (nginx's:
each list gains its weight every turn, the richest goes first and pays the total back). So
a tenant arriving behind another's backlog fills the window's free slots first until the
window holds both in proportion to their weights, instead of half of each take for as long
as the backlog's messages already fill the window. Every list of the step follows, so a
take never leaves free slots while some list holds messages. The window's own order is the
batcher's (``workers.batching.fairshare``).

Without tenant lists (no ``[tenants]``, or only the default one) nothing here runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from shared import schema, tenants
from shared.settings import Settings

__all__ = ["TenantTurns", "tenant_transport_options"]


class TenantTurns:
    """The take order of each (queue, step)'s lists: its priority list (the default tenant's
    weight) and its tenants' lists (``names``, each ``weights[name]``, else 1)."""

    def __init__(
        self, names: Sequence[str], weights: Mapping[str, float], default: str = ""
    ) -> None:
        self.names = tuple(names)
        self.weights = dict(weights)
        self.default = default
        self._lists: dict[tuple[str, int], list[str]] = {}
        self._credit: dict[str, float] = {}
        self._weight: dict[str, float] = {}
        self._where: dict[str, str] = {}  # delivery tag -> the list it was taken from

    def lists(self, queue: str, step: int) -> list[str]:
        """The priority list of ``queue`` at ``step``, then its tenants' lists."""
        found = self._lists.get((queue, step))
        if found is None:
            base = schema.priority_list_key(queue, step)
            own = [tenants.tenant_list_key(queue, step, n) for n in self.names]
            found = self._lists[(queue, step)] = [base, *own]
            self._weight[base] = self.weights.get(self.default, 1.0)
            for key, name in zip(own, self.names, strict=True):
                self._weight[key] = self.weights.get(name, 1.0)
        return found

    def taken(self, key: str, tag: str) -> None:
        """The window holds the message ``tag`` taken from list ``key``."""
        self._where[tag] = key

    def forget(self, held: Collection[str]) -> None:
        """Keep only the messages still ``held`` (the lease keeper's tags)."""
        if len(held) < len(self._where):
            self._where = {t: k for t, k in self._where.items() if t in held}

    def next(self, queue: str, step: int) -> list[str]:
        """The lists of ``queue`` at ``step`` in this take's order: fewest held in the window
        for their weight first, then the one whose round-robin turn it is."""
        group = self.lists(queue, step)
        credit, weight = self._credit, self._weight
        total = 0.0
        for key in group:
            credit[key] = credit.get(key, 0.0) + weight[key]
            total += weight[key]
        held = Counter(self._where.values())
        order = sorted(group, key=lambda k: (held[k] / weight[k], -credit[k]))
        credit[order[0]] -= total
        return order


def tenant_transport_options(settings: Settings) -> dict[str, Any]:
    """The worker channel's transport options for the tenant lists (``Channel.tenant_names``,
    ``tenant_weights``): every ``[tenants]`` tenant but the default one has a list (read in
    ``fifo`` mode too: what was queued before a switch is still taken)."""
    default = settings.tenancy.default_tenant
    names = tuple(sorted(n for n in settings.tenants if n != default))
    if not names:
        return {}
    weights = {n: t.weight for n, t in settings.tenants.items()}
    weights.setdefault(default, 1.0)
    return {"tenant_names": names, "tenant_weights": {"": weights[default], **weights}}
