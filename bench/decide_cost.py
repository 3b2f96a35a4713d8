"""``kvmesh bench decide``: how long one routing decision takes, with its feedback, by fleet size.

Each decision builds the engines' views (as the router does per request), ranks them with ``kv_aware``
for a prompt that one engine holds most of and whose prefix has homes among a few dozen others, then
reports the TTFT and decode observations its request would and records the placement, so the learners
and the home book change between decisions as they do under traffic. ``--against REV`` runs revision
REV's routing code under this same harness in alternating fresh processes and prints the per-pair ratio.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import time
from pathlib import Path

from gateway.routing.registry import make_policy
from gateway.routing.types import EngineView, RouteRequest

PREFIXES = 40
BLOCKS = 900
_MEDIAN = re.compile(r"^([0-9.]+)$", re.MULTILINE)
_RUN_THIS_FILE = "import runpy; print(runpy.run_path({path!r})['measure_decisions']({engines}))"
"""How a pass runs this harness file against another tree's code (its cwd, so first on the import path): the
file imports nothing but the routing core at its top, which every revision has."""


def measure_decisions(engines: int, decisions: int = 300, seed: int = 2) -> float:
    """Median milliseconds per decision plus its feedback, on a fleet of ``engines`` with varied load."""
    rng = random.Random(seed)
    policy = make_policy("kv_aware")
    ids = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(engines)]
    loads = [(rng.randint(0, 8), rng.random() * 0.5) for _ in ids]
    for _ in range(5 * PREFIXES):
        policy.homes.record(f"p{rng.randrange(PREFIXES)}", rng.choice(ids), rng.randint(20, 200), BLOCKS)
    timings = []
    for n in range(decisions + 50):
        key = f"p{rng.randrange(PREFIXES)}"
        holder = rng.randrange(engines)
        start = time.perf_counter()
        views = [EngineView(id=engine, url=f"http://{engine}", running=running, max_num_seqs=256, num_blocks=BLOCKS,
                            kv_usage=usage, exact_blocks=94 if i == holder else 0, held_blocks=BLOCKS - 100,
                            reuse_ratio=0.6, in_flight=running % 3)
                 for i, (engine, (running, usage)) in enumerate(zip(ids, loads, strict=True))]
        request = RouteRequest("model", 1_820, 113, key, max_tokens=64, home_key=key)
        decision = policy.choose(request, views)
        best = decision.table[0]
        policy.observe(best.engine, best.uncached_tokens, best.queue_depth, 0.05 + rng.random() * 0.01)
        policy.observe_decode(best.engine, best.queue_depth, 64, 0.8 + rng.random() * 0.1)
        policy.dispatched(decision, best.engine)
        if n >= 50:  # the first ones warm the learners up
            timings.append(time.perf_counter() - start)
    timings.sort()
    return timings[len(timings) // 2] * 1e3


def pass_command(engines: int) -> list[str]:
    """Python's arguments for one pass of this harness at ``engines``, with whatever code its cwd holds."""
    return ["-c", _RUN_THIS_FILE.format(path=str(Path(__file__).resolve()), engines=engines)]


def main(argv: list[str] | None = None) -> int:
    from bench.revision import add_against_options, side_by_side  # not at the top: see _RUN_THIS_FILE

    parser = argparse.ArgumentParser(prog="kvmesh bench decide", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="3,15,64,256", help="comma-separated fleet sizes")
    add_against_options(parser, "routing code in this harness (the first fleet size)")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.engines.split(",") if x]
    if args.against:
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvmesh-bench-decide-"))
        command = pass_command(sizes[0])
        print(f"{sizes[0]} engines, ms per decision", flush=True)
        for line in side_by_side(args.against, args.passes, command, _MEDIAN, "ms", log_dir):
            print(line, flush=True)
        return 0
    print(f"{'engines':>8} {'decision ms (median)':>22}")
    for size in sizes:
        print(f"{size:>8} {measure_decisions(size):>22.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
