"""Router TOML files for local clusters and benchmarks, and the tables ``kvmesh up`` adds to its routers:
an autoscaler that takes spare engines from a standby pool, and auth with an admin key and two tenants."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from cluster.daemon import REPO_ROOT
from gateway.security.keys import generate_key, hash_key

POOL_SCRIPT = REPO_ROOT / "autoscale" / "providers" / "examples" / "standby_pool.py"
STEADY_TENANT, FLOOD_TENANT = "steady", "flood"
TENANTS = {STEADY_TENANT: "high", FLOOD_TENANT: "low"}
"""The local cluster's tenants and their priorities: chaos floods the low one beside the steady high one."""
SPARE_CAPACITY = 8
"""Requests at once the autoscaler assumes of an engine until it has measured one. With 4, the chaos mix
alone (20 requests/s of short prompts on two engines) took both spares before any fault, so none was left
for the flood; a simulated engine of 4,096 blocks holds three or four of the flood's 17k-token prompts."""


def toml_value(value: object) -> str:
    """TOML for the scalars, lists and strings a router config needs (JSON spells them the same way)."""
    return json.dumps(value)


def write_router_config(path: Path, settings: dict[str, object], tables: dict[str, dict[str, object]],
                        arrays: dict[str, list[dict[str, object]]] | None = None) -> Path:
    """A router TOML file: top-level ``settings``, then ``[table]``s, then ``[[array]]`` entries."""
    lines = [f"{k} = {toml_value(v)}" for k, v in settings.items()]
    for name, table in tables.items():
        lines += [f"[{name}]", *(f"{k} = {toml_value(v)}" for k, v in table.items())]
    for name, entries in (arrays or {}).items():
        for entry in entries:
            lines += [f"[[{name}]]", *(f"{k} = {toml_value(v)}" for k, v in entry.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass(frozen=True)
class ClusterKeys:
    """The API keys of a local cluster with auth: one admin key, one key per tenant."""

    admin: str
    tenants: dict[str, str]

    @classmethod
    def generate(cls) -> ClusterKeys:
        return cls(generate_key(), {name: generate_key() for name in TENANTS})

    def save(self, path: Path) -> Path:
        """Owner-only, like the mesh secret beside it."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"admin": self.admin, "tenants": self.tenants}, f)
        return path

    @classmethod
    def load(cls, path: Path) -> ClusterKeys:
        """ValueError when the file does not hold an admin key and string tenant keys."""
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("admin"), str) or not isinstance(
                data.get("tenants"), dict) or not all(isinstance(v, str) for v in data["tenants"].values()):
            raise ValueError(f"malformed keys file {path}")
        return cls(data["admin"], data["tenants"])

    def tables(self) -> tuple[dict[str, object], list[dict[str, object]]]:
        """The ``[auth]`` table and the ``[[tenants]]`` entries (hashes only)."""
        tenants = [{"name": name, "keys": [hash_key(self.tenants[name])], "priority": priority}
                   for name, priority in TENANTS.items()]
        return {"enabled": True, "admin_keys": [hash_key(self.admin)]}, tenants


def standby_autoscaler(routers: int, engines: int, spare_urls: list[str], pool_file: Path) -> tuple[
        dict[str, object], list[dict[str, object]]]:
    """An ``[autoscaler]`` table (and its one offer) that grows the fleet of ``engines`` from the spares.

    The quorum counts the configured ``routers``, so a replica cut off from the others never acts, and
    the pool script refuses calls with an older lease term than it has seen (the fencing token)."""
    table: dict[str, object] = {
        "enabled": True, "provider": "command",
        "command": [sys.executable, str(POOL_SCRIPT), str(pool_file), *spare_urls],
        "interval_s": 1.0, "lease_ttl_s": 3.0, "replicas": routers,
        "min_engines": engines, "max_engines": engines + len(spare_urls),
        "cooldown_s": 10.0, "step_cooldown_s": 2.0,
    }
    offer: dict[str, object] = {"name": "standby", "capacity": SPARE_CAPACITY, "provisioning_s": 0}
    return table, [offer]
