"""``kvmesh bench decide``: how long one routing decision takes, with its feedback, by fleet size.

Every decision is followed by the TTFT and decode observations its request would report, so the
learners refit between decisions as they do under traffic.
"""

from __future__ import annotations

import argparse
import random
import time

from gateway.routing.registry import make_policy
from gateway.routing.types import EngineView, RouteRequest


def measure_decisions(engines: int, decisions: int = 200, seed: int = 2) -> float:
    """Median milliseconds per decision plus its observations, on a fleet of ``engines`` with varied load."""
    rng = random.Random(seed)
    policy = make_policy("kv_aware")
    views = [EngineView(f"engine-{i}", f"http://10.0.0.{i % 250}:8000", running=rng.randint(0, 8),
                        max_num_seqs=64, num_blocks=4096, kv_usage=rng.random() * 0.5,
                        exact_blocks=rng.randint(0, 60)) for i in range(engines)]
    request = RouteRequest("model", 1000, 62, "prefix", max_tokens=64)
    timings = []
    for _ in range(decisions):
        start = time.perf_counter()
        best = policy.choose(request, views).table[0]
        policy.observe(best.engine, best.uncached_tokens, best.queue_depth, 0.08 + rng.random() * 0.02)
        policy.costs.decode.observe(best.engine, best.queue_depth, 64, 0.8 + rng.random() * 0.1)
        timings.append(time.perf_counter() - start)
    timings.sort()
    return timings[len(timings) // 2] * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh bench decide", description=__doc__)
    parser.add_argument("--engines", default="3,30,100,500", help="comma-separated fleet sizes")
    args = parser.parse_args(argv)
    print(f"{'engines':>8} {'decision ms (median)':>22}")
    for size in (int(x) for x in args.engines.split(",") if x):
        print(f"{size:>8} {measure_decisions(size):>22.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
