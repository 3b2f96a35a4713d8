"""The ``[autoscaler]`` table of the router's configuration (see README: Fleet autoscaler)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from autoscale.decision import ScalePolicy
from autoscale.offers import Offer, Placement

PROVIDERS = ("local", "command")


@dataclass
class AutoscaleConfig:
    enabled: bool = False
    dry_run: bool = False
    provider: str = "local"
    command: list[str] = field(default_factory=list)
    """``command`` provider: the executable and its first arguments (the action is appended)."""
    command_timeout_s: float = 600.0
    command_env: list[str] = field(default_factory=list)
    """``command`` provider: environment variables passed on to the executable, beside PATH, HOME, LANG,
    LC_ALL, TZ and TMPDIR (the router's other variables, its secrets among them, are not)."""
    sim_args: list[str] = field(default_factory=list)
    """``local`` provider: extra ``kvmesh sim`` flags for every engine it starts."""
    provisioning_scale: float = 1.0
    """``local`` provider: multiplies each offer's provisioning latency before a start."""
    interval_s: float = 5.0
    drain_deadline_s: float = 120.0
    lease_ttl_s: float = 3.0
    replicas: int = 0
    """The mesh's size, for the lease's quorum; 0: the member list the lease holder keeps (autoscale/lease.py)."""
    join_s: float = 10.0
    """Without a member list in the document, a replica waits this long after its start before it claims."""
    member_forget_s: float = 60.0
    """A member unseen this long leaves the member list (one that left gracefully leaves at once)."""
    min_engines: int = 1
    max_engines: int = 8
    queue_up: float = 4.0
    queue_drain: float = 0.5
    utilisation_floor: float = 0.35
    target_utilisation: float = 0.7
    hit_ratio_floor: float = 0.2
    saturation: float = 0.9
    ttft_p99_ceiling_s: float = 2.0
    cooldown_s: float = 60.0
    step_cooldown_s: float = 10.0
    down_stable_s: float = ScalePolicy.down_stable_s
    max_step_up: int = 4
    max_step_down: int = 1
    latency_limit_ms: float = 100.0
    cross_island_ms: float = 50.0
    provisioning_limit_s: float = 600.0
    offers: list[Offer] = field(default_factory=list)

    def policy(self) -> ScalePolicy:
        """The decision core's policy: every ScalePolicy field this table sets, under the same name."""
        shared = {f.name: getattr(self, f.name) for f in fields(ScalePolicy) if f.name != "placement"}
        return ScalePolicy(**shared,
                           placement=Placement(self.latency_limit_ms, self.cross_island_ms, self.provisioning_limit_s))

    def validate(self, where: str = "autoscaler") -> None:
        """ValueError naming the key (the router's config loader reports it as a configuration error)."""
        if not self.enabled:
            return
        if self.provider not in PROVIDERS:
            raise ValueError(f"{where}.provider: {self.provider!r} is not {' | '.join(PROVIDERS)}")
        if self.provider == "command" and not self.command:
            raise ValueError(f"{where}.command: the command provider needs an executable")
        if not self.offers:
            raise ValueError(f"{where}.offers: at least one offer is needed")
        for key in ("interval_s", "drain_deadline_s", "lease_ttl_s", "command_timeout_s", "member_forget_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{where}.{key}: must be positive")
        if self.replicas < 0 or self.join_s < 0:
            raise ValueError(f"{where}.replicas, join_s: must not be negative")
        for i, offer in enumerate(self.offers):
            offer.validate(f"{where}.offers[{i}]")
        self.policy().validate(where)
