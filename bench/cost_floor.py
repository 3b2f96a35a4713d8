"""The best TTFT a simulated engine can give a prompt, from its own cost model (sans-IO).

A target stated as a TTFT ratio against round robin is only meaningful if the cost model leaves room
for it: when round robin already finds the shared prefix cached, or the fixed per-request cost dwarfs
the prefill a cache hit saves, no router can reach the ratio. This floor shows how far it can go.
"""

from __future__ import annotations

from sim.profiles import Profile
from sim.timing import cold_and_warm_ttft


def perfect_cache_ttft(profile: Profile, prompt_tokens: int, block_size: int, time_scale: float) -> float:
    """Seconds to the first token on an idle engine holding every full block of the prompt; the
    engine computes the remainder (at least the last token), as vLLM does."""
    return cold_and_warm_ttft(profile, prompt_tokens, block_size)[1] * time_scale
