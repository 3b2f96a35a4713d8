"""The ``[auth]`` and ``[[tenants]]`` config tables: API keys are stored only as sha256 hashes.

Cache salts: an isolated tenant's salt is ``"kvmesh:" + suffix`` where the suffix is the configured
``cache_salt`` or, by default, a hash of the tenant name. The ``kvmesh:`` prefix is reserved: the router
refuses it in client-supplied salts, so no tenant can ever present another tenant's salt, and the salt need
not be secret (no per-cluster secret to distribute; every replica derives the same salt from the config).
Two tenants given the same explicit ``cache_salt`` deliberately share their cache.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from dataclasses import dataclass, field

from gateway.config_errors import ConfigError

PRIORITIES = ("high", "normal", "low")
CACHE_POLICIES = ("isolated", "shared")
RESERVED_SALT_PREFIX = "kvmesh:"
_HASHED_KEY = re.compile(r"sha256:[0-9a-fA-F]{64}")
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_MAX_SALT = 256


def is_hashed_key(value: str) -> bool:
    return bool(_HASHED_KEY.fullmatch(value))


def _check_keys(keys: list[str], where: str) -> None:
    for i, key in enumerate(keys):
        if not is_hashed_key(key):
            # Never echo the value: it may be a real plain-text key pasted by mistake.
            raise ConfigError(f"{where}[{i}]: expected 'sha256:<64 hex digits>'; plain API keys are not "
                              "allowed in config, store the output of `kvmesh keys hash` instead")


def is_loopback_host(host: str) -> bool:
    """Whether a bind address only this machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass
class AuthConfig:
    enabled: bool = False
    admin_keys: list[str] = field(default_factory=list, repr=False)
    allow_open_network: bool = False
    """With auth off, the router binds only loopback unless this says the network in front of it is trusted:
    whoever reaches it is admin (adds engines fleet-wide, drains them, partitions the mesh)."""

    def validate(self, where: str) -> None:
        _check_keys(self.admin_keys, f"{where}.admin_keys")

    def check_exposure(self, host: str) -> None:
        """Refuse to serve everyone as admin on an address others can reach, unless told to."""
        if self.enabled or self.allow_open_network or is_loopback_host(host):
            return
        raise ConfigError(f"host: {host} with auth off would make anyone who reaches it an admin (adding engines "
                          "fleet-wide, draining them, partitioning the mesh); set [auth] enabled = true with "
                          "admin_keys (kvmesh keys generate), bind 127.0.0.1, or, if the network in front of "
                          "this router is trusted, set [auth] allow_open_network = true")


@dataclass
class TenantConfig:
    name: str
    keys: list[str] = field(default_factory=list, repr=False)
    priority: str = "normal"
    cache: str = "isolated"
    """isolated: the tenant's prompts are salted, so only its own requests reuse their KV blocks (timing
    cannot tell another tenant what it sent); shared: reuse across every shared tenant."""
    requests_per_second: float | None = None
    prompt_tokens_per_minute: float | None = None
    allow_priority_header: bool = False
    cache_salt: str | None = None

    def validate(self, where: str) -> None:
        if not _TENANT_NAME.fullmatch(self.name):
            raise ConfigError(f"{where}.name: {self.name!r} must be 1-64 letters, digits, '_', '.' or '-' "
                              "(it appears in metric labels and headers)")
        if not self.keys:
            raise ConfigError(f"{where}.keys: a tenant needs at least one key hash")
        _check_keys(self.keys, f"{where}.keys")
        if self.priority not in PRIORITIES:
            raise ConfigError(f"{where}.priority: {self.priority!r} is not {' | '.join(PRIORITIES)}")
        if self.cache not in CACHE_POLICIES:
            raise ConfigError(f"{where}.cache: {self.cache!r} is not {' | '.join(CACHE_POLICIES)}")
        for key in ("requests_per_second", "prompt_tokens_per_minute"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ConfigError(f"{where}.{key}: must be positive (leave it out for no limit)")
        if self.cache_salt is not None and not (0 < len(self.cache_salt) <= _MAX_SALT
                                                and self.cache_salt.isprintable()):
            raise ConfigError(f"{where}.cache_salt: must be 1-{_MAX_SALT} printable characters")

    def effective_cache_salt(self) -> str:
        """The salt injected for an isolated tenant; identical on every replica that shares the config."""
        suffix = self.cache_salt or hashlib.sha256(f"kvmesh-tenant\0{self.name}".encode()).hexdigest()[:32]
        return RESERVED_SALT_PREFIX + suffix


def validate_security(auth: AuthConfig, tenants: list[TenantConfig]) -> None:
    """Check each table, then what only the whole picture shows: duplicate names, a key in two tenants."""
    auth.validate("auth")
    names: set[str] = set()
    owner: dict[str, str] = {}
    for i, tenant in enumerate(tenants):
        where = f"tenants[{i}]"
        tenant.validate(where)
        if tenant.name in names:
            raise ConfigError(f"{where}.name: tenant {tenant.name!r} is defined twice")
        names.add(tenant.name)
        for j, key in enumerate(tenant.keys):
            digest = key.lower()
            if digest in owner and owner[digest] != tenant.name:
                raise ConfigError(f"{where}.keys[{j}]: this key already belongs to tenant {owner[digest]!r}")
            owner[digest] = tenant.name
    if auth.enabled and not tenants and not auth.admin_keys:
        raise ConfigError("auth.enabled: no tenants and no admin keys are configured"
                          "; every request would get 401")
