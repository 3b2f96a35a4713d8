"""Micro-benchmarks of the prefix index: memory per block held and lookup time for a long prompt."""

from __future__ import annotations

import random
import time
import tracemalloc

from index.block_hash import chain, root_seed
from index.prefix_index import PrefixIndex


def measure_index(blocks: int = 1_000_000, engines: int = 4, prompt_blocks: int = 2048,
                  block_size: int = 16, repeats: int = 50) -> dict[str, float]:
    """Fill an index with `blocks` blocks spread over `engines`, then time a full-hit lookup.

    Engine hashes are 60-bit, as `engine_hash_to_int` folds them before they reach the index.

    Returns bytes per block held (tracemalloc, everything the index allocated) and the median lookup
    time in milliseconds for a prompt of `prompt_blocks` blocks that one engine holds entirely.
    """
    rng = random.Random(7)
    seed = root_seed("bench-model")
    prompt = chain([rng.randrange(50_000) for _ in range(prompt_blocks * block_size)], block_size, seed)
    names = [f"engine-{i}" for i in range(engines)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex()
    index.store(names[0], [(rng.getrandbits(60), key) for key in prompt])
    batch = 4096
    remaining = blocks - len(prompt)
    while remaining > 0:
        n = min(batch, remaining)
        index.store(rng.choice(names), [(rng.getrandbits(60), rng.getrandbits(60)) for _ in range(n)])
        remaining -= n
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = index.overlap(prompt)
        timings.append(time.perf_counter() - start)
    assert result.get(names[0]) == len(prompt)
    timings.sort()
    return {
        "blocks": float(blocks),
        "bytes_per_block": held / blocks,
        "index_mb": held / 1e6,
        "lookup_ms_median": timings[len(timings) // 2] * 1e3,
        "lookup_ms_max": timings[-1] * 1e3,
        "prompt_blocks": float(prompt_blocks),
    }


def measure_chain(tokens: int = 32_768, block_size: int = 16, repeats: int = 20) -> dict[str, float]:
    """Median time to compute the own-key chain of a `tokens`-long prompt."""
    rng = random.Random(3)
    ids = [rng.randrange(50_000) for _ in range(tokens)]
    seed = root_seed("bench-model")
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        chain(ids, block_size, seed)
        timings.append(time.perf_counter() - start)
    timings.sort()
    return {"tokens": float(tokens), "chain_ms_median": timings[len(timings) // 2] * 1e3}


def main(argv: list[str] | None = None) -> int:
    """``kvmesh bench index``: memory per block held and lookup/hash time for a 32k-token prompt."""
    for name, value in {**measure_index(), **measure_chain()}.items():
        print(f"{name:20} {value:12.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
