"""What loading a block from an engine's offloaded tier costs: the price the router puts on a lower-tier hit.

A block in an engine's CPU or storage tier (index/tiers.py) is neither free like a GPU hit nor a full
prefill like a miss: the engine's connector copies it back, ``bytes per block / tier bandwidth`` seconds.
The defaults describe an 8B-class GQA model in bf16 (2 x 32 layers x 8 KV heads x 128 dims x 2 bytes =
128 KiB per token), a CPU tier over PCIe 4.0 x16 (~20 GB/s achieved) and an NVMe-class storage tier
(~2 GB/s): a 16-token block loads in 0.1 ms from CPU and 1 ms from storage, where its prefill is about
1 ms on an A100-class engine. Set per engine; ``enabled = false`` routes as if the tiers did not exist.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.config_errors import ConfigError
from index.tiers import TIER_MEDIA, TierRun

DEFAULT_KV_BYTES_PER_TOKEN = 131_072
DEFAULT_BANDWIDTH_GBPS = {"CPU": 20.0, "STORAGE": 2.0}


@dataclass
class TierConfig:
    enabled: bool = True
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    bandwidth_gbps: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_BANDWIDTH_GBPS))
    """GB/s (1e9 bytes) from each lower tier back to the engine's KV cache; a tier not named takes its default."""

    def validate(self, where: str) -> None:
        if self.kv_bytes_per_token <= 0:
            raise ConfigError(f"{where}.kv_bytes_per_token: must be positive")
        for medium, gbps in self.bandwidth_gbps.items():
            if medium not in TIER_MEDIA:
                raise ConfigError(f"{where}.bandwidth_gbps.{medium}: unknown tier (one of {', '.join(TIER_MEDIA)})")
            if not math.isfinite(gbps) or gbps <= 0:
                raise ConfigError(f"{where}.bandwidth_gbps.{medium}: must be a positive number")

    def block_load_s(self, medium: str, block_size: int) -> float:
        """Seconds to bring one block of ``block_size`` tokens back from ``medium``."""
        gbps = self.bandwidth_gbps.get(medium) or DEFAULT_BANDWIDTH_GBPS[medium]
        return block_size * self.kv_bytes_per_token / (gbps * 1e9)

    def priced_runs(self, runs: Sequence[TierRun], block_size: int) -> tuple[tuple[str, int, float], ...]:
        """The runs as the cost model takes them: (medium, blocks, seconds per block); none when disabled."""
        if not self.enabled:
            return ()
        return tuple((run.medium, run.blocks, self.block_load_s(run.medium, block_size)) for run in runs)
