"""The one settings type of a mesh replica: what its node, gossip membership and replication read."""

from __future__ import annotations

from dataclasses import dataclass, field

from mesh.seeds import parse_hostport
from mesh.swim import SwimConfig

WILDCARDS = ("0.0.0.0", "::")


@dataclass(frozen=True, slots=True)
class MeshSettings:
    """Addresses are ``host:port`` (port 0 = any free port). The secret never shows in a repr."""

    secret: bytes = field(repr=False)
    name: str = "router"
    bind: str = "127.0.0.1:7946"
    advertise: str | None = None
    seeds: tuple[str, ...] = ()
    replication_bind: str = "127.0.0.1:0"
    http_addr: str = ""
    island: str = ""
    cluster: str = "kvmesh"
    redis_url: str | None = None
    redis_seed_ttl: float = 10.0
    snapshot_interval: float = 5.0
    anti_entropy_interval: float = 1.0
    swim: SwimConfig = field(default_factory=SwimConfig)

    def validate(self) -> None:
        for name in ("snapshot_interval", "anti_entropy_interval", "redis_seed_ttl"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for bind in (self.bind, self.replication_bind):
            if parse_hostport(bind)[0] in WILDCARDS and not self.advertise:
                raise ValueError(f"binding the wildcard address {bind} needs an explicit advertise address")
        for seed in self.seeds:
            parse_hostport(seed)
