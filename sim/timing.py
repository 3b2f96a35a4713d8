"""Step duration from the cost model (sans-IO): what one scheduler step of a batch costs."""

from __future__ import annotations

from dataclasses import dataclass

from sim.profiles import Profile


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Prompt tokens computed in one step on top of `context` already computed (or cache-hit) tokens."""

    new_tokens: int
    context: int


@dataclass(frozen=True, slots=True)
class DecodeSeq:
    """One sequence generating a token, attending over `context` tokens."""

    context: int


def prefill_cost(profile: Profile, chunk: PrefillChunk) -> float:
    """Linear in the new tokens plus attention over the context and the chunk itself."""
    n = chunk.new_tokens
    return profile.prefill_token_s * n + profile.attention_pair_s * n * (chunk.context + n / 2)


def step_duration(profile: Profile, prefills: list[PrefillChunk], decodes: list[DecodeSeq]) -> float:
    """Seconds of engine time for one step; zero when the batch is empty."""
    if not prefills and not decodes:
        return 0.0
    total = profile.step_base_s
    total += sum(prefill_cost(profile, c) for c in prefills)
    total += profile.decode_seq_s * len(decodes)
    total += profile.kv_read_token_s * sum(d.context for d in decodes)
    return total


def cold_and_warm_ttft(profile: Profile, prompt_tokens: int, block_size: int) -> tuple[float, float]:
    """Model TTFT at c=1 for a prompt seen for the first time and for the same prompt again.

    Warm, vLLM reuses whole blocks but always recomputes at least the last prompt token.
    """
    cached = ((prompt_tokens - 1) // block_size) * block_size
    cold = profile.frontend_s + step_duration(profile, [PrefillChunk(prompt_tokens, 0)], [])
    warm = profile.frontend_s + step_duration(profile, [PrefillChunk(prompt_tokens - cached, cached)], [])
    return cold, warm
