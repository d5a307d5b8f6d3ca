"""Which tenant a gateway request is for (``shared.tenants``). Pure logic.

In order of authority:

1. the tenant its bearer token is bound to (``[tenants.<name>] gateway_token``,
   ``producer.gateway.auth``): the request is that tenant's; a header or parameter naming
   another tenant is refused ``TENANT_FORBIDDEN`` (403), never followed (least privilege: a
   tenant's client cannot spend another tenant's quota or share);
2. the ``X-Fleet-Tenant`` header, and OIP's request ``parameters.tenant``: when both are
   given they must agree (else ``INVALID_INPUT``);
3. neither: the default tenant (the request names none).
"""

from __future__ import annotations

from typing import Any

from producer.gateway.errors import TenantForbidden
from shared import tenants
from shared.errors import InvalidInput

__all__ = ["TENANT_HEADER", "request_tenant"]

TENANT_HEADER = "x-fleet-tenant"


def request_tenant(bound: str | None, header: str | None, parameter: Any) -> str | None:
    """The request's tenant (``None``: the default one), from the token's ``bound`` tenant,
    the ``X-Fleet-Tenant`` ``header`` and ``parameters.tenant`` (see the module docstring).

    Raises:
        TenantForbidden: the token is bound to a tenant and the request names another.
        InvalidInput: a malformed name, or a header and a parameter that disagree.
    """
    named = {tenants.check_name(v) for v in (header, parameter) if v is not None}
    if bound is not None:
        others = named - {bound}
        if others:
            raise TenantForbidden(
                f"this token is bound to tenant {bound!r}; it cannot send requests of "
                f"{sorted(others)[0]!r}"
            )
        return bound
    if len(named) > 1:
        raise InvalidInput(
            f"X-Fleet-Tenant ({header!r}) and parameters.tenant ({parameter!r}) disagree"
        )
    return next(iter(named), None)
