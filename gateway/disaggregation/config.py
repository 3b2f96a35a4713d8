"""The ``[pd]`` table of the router's configuration: when the prefill leg is skipped and what a failed one costs."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config_errors import ConfigError

PREFILL_FAILOVER = ("prefill", "decode")


@dataclass
class PdConfig:
    min_prefill_tokens: int = 512
    """Prompts shorter than this are served whole on the decode engine: a prefill leg costs a second
    request's fixed latency (64 ms on the a40 profile) and a transfer, more than such a prefill saves."""
    max_uncached_blocks: int = 4
    """The decode engine holds all of the prompt but at most this many blocks: it prefills the rest itself."""
    prefill_failover: str = "prefill"
    """A prefill leg that fails: ``prefill`` tries the next prefill engine (up to ``prefill_attempts``) and then
    serves the request whole on the decode engine; ``decode`` goes to the decode engine at once."""
    prefill_attempts: int = 2
    lease_s: float = 30.0
    """How long a prefill engine holds the handed-over blocks (vLLM's ``kv_lease_duration``, 30 s)."""
    lease_margin_s: float = 1.0
    """A decode leg is sent with the handoff only this long before the lease ends at the latest: the lease
    starts when the prefill finished, a little before its answer reached the router."""

    def validate(self, where: str) -> None:
        if self.prefill_failover not in PREFILL_FAILOVER:
            raise ConfigError(f"{where}.prefill_failover: {self.prefill_failover!r} is not prefill | decode")
        for key in ("min_prefill_tokens", "max_uncached_blocks"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{where}.{key}: must not be negative")
        if self.prefill_attempts < 1:
            raise ConfigError(f"{where}.prefill_attempts: must be at least 1")
        if self.lease_s <= 0 or not 0 <= self.lease_margin_s < self.lease_s:
            raise ConfigError(f"{where}.lease_s must be positive and lease_margin_s in [0, lease_s)")
