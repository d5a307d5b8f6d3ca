"""Tenants: who a request is for, where its message waits, and its share of the fleet.

A request may name a ``tenant`` (``TaskEnvelope.tenant``: the client's ``tenant=``
argument, ``fleet submit --tenant``, the gateway's ``parameters.tenant``, its
``X-Fleet-Tenant`` header or the tenant its token maps to). A request without one belongs to
the default tenant (``[tenancy] default_tenant``). A name is 1 to 64 of ``A-Z a-z 0-9 . _ -``
(it is part of Redis keys).

``[tenants.<name>]`` gives a tenant its ``max_queued`` (``shared.tenant_quota``) and its
``weight`` (its share within a priority class; ``workers.batching.fairshare``). With
``[tenancy] share = "fair"``, the requests of each tenant named in ``[tenants]`` (but the
default one) wait in lists of their own beside each priority list of their queue::

    <queue>\\x06\\x16<step>\\x1f<tenant>      e.g. "text\\x06\\x169\\x1facme"

(the step is written even for step 0, so that a worker reading the queue name back from the
list name, ``rsplit`` at kombu's separator, finds the queue). A worker takes from its queues'
lists step by step (priority order unchanged) and, within a step, from the tenants' lists in
turns, the list its window holds fewest of for its weight first
(``workers.consumer.tenant_turns``): a tenant's backlog of thousands of messages no longer
sits ahead of another tenant's in one Redis list. Every other tenant, and the
default one, shares the priority list itself. A message's ``routing_key`` is its queue, so
kombu's restore of a lapsed lease returns it to the shared priority list: it is taken from
there like any other.

Producers and workers must agree on ``[tenants]`` and ``[tenancy]`` (as on ``[priorities]``):
a tenant list no worker knows is not read (its messages wait; ``fleet status`` and the
exporter count them when their own settings name the tenant).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.errors import InvalidInput
from shared.schema import PRIORITY_SEP
from shared.settings import TENANT_NAME, Settings

__all__ = [
    "TENANT_SEP",
    "check_name",
    "effective",
    "has_own_list",
    "kwargs_tenant",
    "tenant_list_key",
    "tenant_lists",
]


TENANT_SEP = "\x1f"  # between a priority list's name and its tenant's


def check_name(name: Any) -> str:
    """``name`` if it is a valid tenant name.

    Raises:
        InvalidInput: not a string of 1 to 64 of ``A-Z a-z 0-9 . _ -`` (starting with a
            letter or digit).
    """
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise InvalidInput(
            f"tenant must be 1 to 64 of A-Z a-z 0-9 . _ - (a letter or digit first), not {name!r}"
        )
    return name


def effective(settings: Settings, tenant: str | None) -> str:
    """The tenant a request of ``tenant`` (``None``: none named) belongs to."""
    return settings.tenancy.default_tenant if tenant is None else tenant


def has_own_list(settings: Settings, tenant: str | None) -> bool:
    """Whether a request of ``tenant`` waits in a tenant list of its own (fair share on and
    the tenant named in ``[tenants]``, not the default one)."""
    return (
        tenant is not None
        and settings.tenancy.share == "fair"
        and tenant in settings.tenants
        and tenant != settings.tenancy.default_tenant
    )


def tenant_list_key(queue: str, step: int, tenant: str) -> str:
    """The list of ``tenant``'s messages of ``queue`` at Celery priority ``step``."""
    return f"{queue}{PRIORITY_SEP}{step}{TENANT_SEP}{tenant}"


def tenant_lists(settings: Settings, queue: str, step: int) -> list[str]:
    """The tenant lists of ``queue`` at ``step`` (every ``[tenants]`` tenant's but the default
    one's), in the tenants' name order. Read and counted in either mode: producers push to
    them only with ``share = "fair"``, but messages pushed before a switch to FIFO are still
    there."""
    default = settings.tenancy.default_tenant
    return [tenant_list_key(queue, step, t) for t in sorted(settings.tenants) if t != default]


def kwargs_tenant(kwargs: Any) -> str | None:
    """The tenant named in a task's kwargs (its envelope), or ``None``."""
    env = kwargs.get("request") if isinstance(kwargs, Mapping) else None
    tenant = env.get("tenant") if isinstance(env, Mapping) else None
    return tenant if isinstance(tenant, str) else None
