"""Per-tenant KV-cache isolation through vLLM's ``cache_salt``.

The salt enters the first block's hash on the engine, so tenants with different salts never share a
block; the router keys its own index with the same salt, so routing never reveals another tenant's cache.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.openai_errors import ApiError
from gateway.security.auth import Tenant
from gateway.security.config import RESERVED_SALT_PREFIX


def apply_cache_policy(
    tenant: Tenant, body: dict[str, Any], raw: bytes
) -> tuple[dict[str, Any], bytes, str | None]:
    """The body to forward and the salt to key the index with.

    Isolated tenants always get their own salt (a client-supplied one is overridden). Shared tenants keep
    the client's salt, but may not use the reserved ``kvmesh:`` prefix of tenant salts (400): otherwise a
    shared tenant could present an isolated tenant's salt and read its cache through timing. The body is
    re-serialised only when it changes, so the engine gets the client's exact bytes otherwise.
    """
    client_salt = body.get("cache_salt")
    if client_salt is not None and not isinstance(client_salt, str):
        raise ApiError(400, "'cache_salt' must be a string", param="cache_salt")
    if tenant.cache == "isolated" and tenant.cache_salt is not None:
        if client_salt == tenant.cache_salt:
            return body, raw, client_salt
        salted = {**body, "cache_salt": tenant.cache_salt}
        return salted, json.dumps(salted, separators=(",", ":")).encode(), tenant.cache_salt
    if client_salt is not None and client_salt.startswith(RESERVED_SALT_PREFIX):
        raise ApiError(400, f"'cache_salt' may not start with {RESERVED_SALT_PREFIX!r}", param="cache_salt")
    return body, raw, client_salt
