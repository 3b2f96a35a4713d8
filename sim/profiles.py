"""Named hardware profiles: the constants of the step-time cost model (see sim/timing.py).

Calibration of `a40-qwen1.5b` (published: prefix-aware gateway, 2x A40, Qwen2.5-1.5B, c=1,
TTFT 166.4 ms cold vs 77.4 ms warm for the same prompt). A ~2k-token shared document (2048 prompt
tokens, block 16) is what such a benchmark implies: warm, vLLM recomputes only the last block
(2032 tokens hit, 16 computed). Solving
    frontend + step_base + prefill(2048 | ctx 0)   = 0.166 s
    frontend + step_base + prefill(16   | ctx 2032) = 0.077 s
with a quadratic attention share of ~10% at 2k gives ~25k prefill tokens/s (about 45% MFU for a
1.5B model on an A40) and ~64 ms of fixed per-request latency (API server, tokenization,
detokenization) plus a 12 ms step (decode ITL of a small model).

`h100-70b`: a 70B-class model on H100s (TP), prefill of 4k tokens about one second, 30 ms ITL.
`fast`: near-zero costs for demos and functional tests.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Profile:
    """Cost-model constants, in seconds of engine time (before --time-scale)."""

    name: str
    frontend_s: float
    """Fixed per-request latency outside the scheduler (HTTP, tokenize, detokenize)."""
    step_base_s: float
    """Fixed cost of one forward pass (kernel launches, sampling, scheduling)."""
    prefill_token_s: float
    """Linear cost per newly computed prompt token (the MLP/projection FLOPs)."""
    attention_pair_s: float
    """Quadratic attention cost per (new token x attended context token) pair."""
    decode_seq_s: float
    """Extra cost per sequence in a decode batch."""
    kv_read_token_s: float
    """Cost per context token read by decoding sequences (memory bandwidth)."""
    max_num_batched_tokens: int
    """Token budget of one step (chunked prefill splits longer prompts)."""
    kv_bytes_per_token: float = 28_672.0
    """KV cache bytes of one token, what a decode engine pulls from a prefill engine (sim/roles.py): layers x
    2 (K and V) x KV heads x head dim x 2 bytes; Qwen2.5-1.5B: 28 x 2 x 2 x 128 x 2."""
    link_bytes_per_s: float = 25e9
    """The prefill-to-decode link (200 Gb/s RDMA): a 4k-token prompt's 117 MB take 4.7 ms on it."""


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="a40-qwen1.5b",
            frontend_s=0.0642,
            step_base_s=0.012,
            prefill_token_s=3.94e-5,
            attention_pair_s=4.3e-9,
            decode_seq_s=1.5e-4,
            kv_read_token_s=2.0e-8,
            max_num_batched_tokens=8192,
        ),
        Profile(
            name="h100-70b",
            frontend_s=0.020,
            step_base_s=0.030,
            prefill_token_s=1.9e-4,
            attention_pair_s=2.0e-8,
            decode_seq_s=4.0e-4,
            kv_read_token_s=1.0e-7,
            max_num_batched_tokens=8192,
            kv_bytes_per_token=327_680.0,  # 80 layers x 2 x 8 KV heads x 128 x 2 bytes
            link_bytes_per_s=50e9,
        ),
        Profile(
            name="fast",
            frontend_s=0.0005,
            step_base_s=0.001,
            prefill_token_s=1.0e-6,
            attention_pair_s=0.0,
            decode_seq_s=1.0e-5,
            kv_read_token_s=0.0,
            max_num_batched_tokens=8192,
        ),
    )
}

DEFAULT_PROFILE = "fast"


def get_profile(name: str) -> Profile:
    """Look a profile up by name; the error lists the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
