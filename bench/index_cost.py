"""Micro-benchmarks of the prefix index: memory per block held and lookup time for a long prompt."""

from __future__ import annotations

import argparse
import multiprocessing
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
    _fill(index, rng, names, blocks - len(prompt))
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


def _fill(index: PrefixIndex, rng: random.Random, names: list[str], blocks: int) -> None:
    """Store ``blocks`` random blocks (60-bit engine hashes and own keys) in batches of 4096, each batch on a
    random engine."""
    while blocks > 0:
        n = min(4096, blocks)
        index.store_many(rng.choice(names), [rng.getrandbits(60) for _ in range(n)],
                         [rng.getrandbits(60) for _ in range(n)])
        blocks -= n


def _rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def _rss_per_block(blocks: int, engines: int) -> float:
    rng = random.Random(7)
    before = _rss()
    index = PrefixIndex()
    _fill(index, rng, [f"engine-{i}" for i in range(engines)], blocks)
    return (_rss() - before) / blocks


def measure_rss(blocks: int = 4_000_000, engines: int = 16) -> dict[str, float]:
    """RSS per block held as the operating system sees it (allocator slack included, which tracemalloc's
    count leaves out), from an index filled in a fresh process so nothing else is in the figure."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        per_block = pool.apply(_rss_per_block, (blocks, engines))
    return {"rss_blocks": float(blocks), "rss_bytes_per_block": per_block}


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
    """``kvmesh bench index``: memory per block held (traced at 1M blocks, RSS at 4M over 16 engines) and
    lookup/hash time for a 32k-token prompt."""
    parser = argparse.ArgumentParser(prog="kvmesh bench index")
    parser.add_argument("--rss-blocks", type=int, default=4_000_000,
                        help="blocks of the RSS measurement (0: skip it; 4M takes about half a minute)")
    args = parser.parse_args(argv)
    results = {**measure_index(), **measure_chain()}
    if args.rss_blocks > 0:
        results |= measure_rss(args.rss_blocks)
    for name, value in results.items():
        print(f"{name:20} {value:12.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
