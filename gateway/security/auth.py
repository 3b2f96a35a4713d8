"""Who is calling: a bearer token resolves to a tenant (or to nothing), and admin keys unlock admin paths.

A presented key is hashed and looked up by its digest: the lookup compares digests, not the secret, so its
timing tells an attacker nothing about any stored key. Tenant objects carry no key material at all, so
they are safe to log, put in metrics or explain in route headers.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from gateway.openai_errors import ApiError
from gateway.security.config import AuthConfig, TenantConfig

ANONYMOUS_NAME = "anonymous"
_MAX_HEADER = 4096


@dataclass(frozen=True, slots=True)
class Tenant:
    """What the router needs per request: identity, priority class, cache policy and limits."""

    name: str
    priority: str = "normal"
    cache: str = "shared"
    cache_salt: str | None = None
    requests_per_second: float | None = None
    prompt_tokens_per_minute: float | None = None
    allow_priority_header: bool = False

    @classmethod
    def from_config(cls, config: TenantConfig) -> Tenant:
        return cls(name=config.name, priority=config.priority, cache=config.cache,
                   cache_salt=config.effective_cache_salt() if config.cache == "isolated" else None,
                   requests_per_second=config.requests_per_second,
                   prompt_tokens_per_minute=config.prompt_tokens_per_minute,
                   allow_priority_header=config.allow_priority_header)


ANONYMOUS = Tenant(ANONYMOUS_NAME, allow_priority_header=True)
"""Everyone when auth is off: shared cache, no limits, and clients may pick their priority."""
ADMIN = Tenant("admin")
"""An admin key that is no tenant's key, on the one non-admin path it may use (``/debug/route``)."""


def bearer_token(header: str | None) -> str | None:
    """The token of ``Authorization: Bearer <token>``; None for anything else (never raises)."""
    if not header or len(header) > _MAX_HEADER:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or any(c.isspace() for c in token):
        return None
    return token


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def _parse_hash(value: str) -> bytes:
    return bytes.fromhex(value.split(":", 1)[1])


class Authenticator:
    def __init__(self, auth: AuthConfig, tenants: list[TenantConfig]) -> None:
        """Expects configs that passed ``validate_security``."""
        self.enabled = auth.enabled
        self._admin = [_parse_hash(k) for k in auth.admin_keys]
        self._tenants: dict[bytes, Tenant] = {}
        for config in tenants:
            tenant = Tenant.from_config(config)
            for key in config.keys:
                self._tenants[_parse_hash(key)] = tenant

    def resolve(self, authorization: str | None) -> Tenant | None:
        """The caller's tenant; the anonymous tenant when auth is off; None for a missing or unknown key."""
        if not self.enabled:
            return ANONYMOUS
        token = bearer_token(authorization)
        if token is None:
            return None
        return self._tenants.get(_digest(token))

    def authenticate(self, authorization: str | None) -> Tenant:
        """``resolve`` or the 401 the router answers (OpenAI's shape; the key is never echoed)."""
        tenant = self.resolve(authorization)
        if tenant is None:
            raise _unauthorized(authorization)
        return tenant

    def is_admin(self, authorization: str | None) -> bool:
        """True for an admin key, or for anyone when auth is off (a local, open deployment)."""
        if not self.enabled:
            return True
        token = bearer_token(authorization)
        if token is None:
            return False
        digest = _digest(token)
        return any([hmac.compare_digest(digest, admin) for admin in self._admin])

    def admin_as_tenant(self, authorization: str | None) -> Tenant:
        """The tenant of an admin caller (401/403 for anyone else): its own when the key is also a tenant's."""
        self.require_admin(authorization)
        return self.resolve(authorization) or ADMIN

    def require_admin(self, authorization: str | None) -> None:
        """401 without a valid key, 403 for a tenant key that is not an admin key."""
        if self.is_admin(authorization):
            return
        if self.resolve(authorization) is None:
            raise _unauthorized(authorization)
        raise ApiError(403, "This endpoint needs an admin key.", code="admin_key_required")


def _unauthorized(authorization: str | None) -> ApiError:
    if bearer_token(authorization) is None:
        return ApiError(401, "You didn't provide an API key. Provide it as 'Authorization: Bearer <key>'.",
                        code="missing_api_key")
    return ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
