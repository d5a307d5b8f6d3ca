"""Bearer-token authentication: every route except liveness needs ``Authorization: Bearer``
(and the API page's shell, ``/docs``, which names nothing: ``routes_docs``).

The token is ``[gateway] token`` (``FLEET_GATEWAY__TOKEN``), else ``<run_dir>/gateway.token``,
a 0600 file created on first start like the Redis password (``Settings.gateway_token``).
Every gateway process of one run directory reads the same file, so they accept the same token.
"""

from __future__ import annotations

import hmac

from producer.gateway.errors import Unauthorized

PUBLIC_PATHS = frozenset({"/v2/health/live"})


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
