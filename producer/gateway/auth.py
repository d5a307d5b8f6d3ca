"""Bearer-token authentication: every route except liveness needs ``Authorization: Bearer``
(and the API page's shell, ``/docs``, which names nothing: ``routes_docs``).

The token is ``[gateway] token`` (``FLEET_GATEWAY__TOKEN``), else ``<run_dir>/gateway.token``,
a 0600 file created on first start like the Redis password (``Settings.gateway_token``).
Every gateway process of one run directory reads the same file, so they accept the same token.

A tenant's own token (``[tenants.<name>] gateway_token``) is accepted too, and binds the
request to that tenant (``producer.gateway.tenancy``): least privilege, a tenant's client
cannot name another tenant.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from producer.gateway.errors import Unauthorized

PUBLIC_PATHS = frozenset({"/v2/health/live"})


def bearer_tenant(header: str | None, token: str, tenant_tokens: Mapping[str, str]) -> str | None:
    """The tenant the bearer token is bound to (``[tenants.<name>] gateway_token``), or
    ``None`` for the gateway's own token. Every token is compared in constant time.

    Raises:
        Unauthorized: missing header, another scheme, or a token that is none of them.
    """
    try:
        check_bearer(header, token)
        return None
    except Unauthorized:
        if not tenant_tokens:
            raise
    found = None
    for tenant, bound in sorted(tenant_tokens.items()):
        try:
            check_bearer(header, bound)
            found = tenant
        except Unauthorized:
            continue
    if found is None:
        check_bearer(header, token)  # raises its own reason (missing, scheme, invalid)
    return found


def check_bearer(header: str | None, token: str) -> None:
    """Accept ``Bearer <token>`` (scheme case-insensitive, compared in constant time).

    Raises:
        Unauthorized: missing header, another scheme, or a wrong token.
    """
    if not header:
        raise Unauthorized("missing Authorization: Bearer <token>")
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not value:
        raise Unauthorized("Authorization must be 'Bearer <token>'")
    if not hmac.compare_digest(value.strip().encode(), token.encode()):
        raise Unauthorized("invalid token")
