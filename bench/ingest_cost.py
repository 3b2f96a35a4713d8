"""``kvmesh bench ingest``: where a replica's CPU goes per KV-event block op, on the realistic mix, in process.

The same recorded batches of E synthetic engines (bench/event_mix.py), each engine already at its cap, go
through the replica's real ingest code in four kinds of pass, each on a fresh index filled the same way (every
kind ``--repeat`` times, interleaved; each figure is the median of its passes, and the line also gives the range of
the end-to-end passes: one pass moved by up to a fifth between minutes of a quiet machine here):

- decode: ``events.decode.decode_live`` of every message, each batch dropped once decoded;
- keys: the own-key chains of every stored event (``index.block_hash.chain_from``, as ingest computes them);
- apply: ``EngineIngest.apply`` of the decoded batches (keys and the index update); store = apply - keys;
- end to end: ``EngineFeed.on_live`` of the raw frames (decode, sequence tracking, keys, store, freshness,
  metrics); the rest = end to end - decode - apply.

CPU time of this thread only, so other processes on the machine do not count; each figure is per block op
(one block stored or removed).

``--replicated`` gives every engine a twin that is sent each of its messages right after it (the same blocks, the
same keys): every block is then held by two engines, as a prompt every engine computes or a hot prefix's replica
is, and half the stores and evictions change the mask of a block another engine holds.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.ingest_split import measure_split, warmed_fleet
from bench.ingest_zmq import measure_over_zmq
from bench.recorded_events import MODEL, Message, freeze, recorded_mix
from bench.revision import add_against_options, side_by_side
from events.decode import decode_live
from events.feed import EngineFeed
from index.block_hash import chain_from, root_seed
from index.events import BlockStored, EventBatch
from index.ingest import EngineIngest
from index.view import CacheView


@dataclass(frozen=True)
class IngestCost:
    engines: int
    live_blocks: int
    ops: int
    decode_us: float
    keys_us: float
    store_us: float
    rest_us: float
    passes: int = 1
    total_range_us: tuple[float, float] = (0.0, 0.0)
    replicated: bool = False

    @property
    def total_us(self) -> float:
        return self.decode_us + self.keys_us + self.store_us + self.rest_us

    def line(self) -> str:
        low, high = self.total_range_us
        fleet = f"{self.engines // 2} engines and a twin of each" if self.replicated else f"{self.engines} engines"
        return (f"ingest CPU per block op, {fleet}, {self.live_blocks:,} live blocks, "
                f"{self.ops:,} ops: {self.total_us:.2f} us (decode {self.decode_us:.2f}, keys {self.keys_us:.2f}, "
                f"store {self.store_us:.2f}, rest {self.rest_us:.2f}) = {1e6 / self.total_us:,.0f} ops/s per core"
                f" (medians of {self.passes} passes; end to end {low:.2f}-{high:.2f})")


def _decode_each(messages: list[Message]) -> None:
    """Decode every message and drop the batch, as ingest does: keeping them all (for the apply pass) made
    the timed decode 1.5-2x what decoding costs alone, and left the end-to-end rest negative."""
    for _, frames in messages:
        decode_live(frames)


def _cpu(work: Callable[[], object]) -> float:
    started = time.thread_time()
    work()
    return time.thread_time() - started


def twinned(messages: list[Message], engines: int) -> list[Message]:
    """Each engine's messages followed by the same frames for its twin (engine number + ``engines``)."""
    return [twin for i, frames in messages for twin in ((i, frames), (i + engines, frames))]


def measure(engines: int = 16, cap: int = 20_000, steps: int = 100, seed: int = 0, passes: int = 3,
            replicated: bool = False) -> IngestCost:
    mix = recorded_mix(engines, cap, steps, seed)
    warm, messages, ops = mix.fill, mix.steady, mix.steady_ops
    if replicated:
        warm, messages, ops, engines = twinned(warm, engines), twinned(messages, engines), 2 * ops, 2 * engines

    def fresh() -> tuple[CacheView, list[EngineFeed]]:
        return warmed_fleet(engines, warm)

    freeze()
    batches: list[tuple[int, EventBatch]] = [(i, decode_live(frames)) for i, frames in messages]
    root = root_seed(MODEL)
    stored = [e for _, b in batches for e in b.events if isinstance(e, BlockStored)]

    def apply_pass() -> float:
        view, _ = fresh()
        ingests = [EngineIngest(f"e{i}", MODEL, view.store) for i in range(engines)]
        return _cpu(lambda: [ingests[i].apply(batch) for i, batch in batches])

    def total_pass() -> float:
        view, feeds = fresh()
        seconds = _cpu(lambda: [feeds[i].on_live(frames, 1.0) for i, frames in messages])
        live.append(sum(view.store.block_count(f"e{i}") for i in range(engines)))
        return seconds

    live: list[int] = []
    timings: dict[str, list[float]] = {"decode": [], "keys": [], "apply": [], "total": []}
    freeze()
    for _ in range(max(1, passes)):
        timings["decode"].append(_cpu(lambda: _decode_each(messages)))
        timings["keys"].append(_cpu(lambda: [chain_from(root, e.token_ids, e.block_size) for e in stored]))
        timings["apply"].append(apply_pass())
        timings["total"].append(total_pass())
    us = 1e6 / ops
    decode_s, keys_s, apply_s, total_s = (statistics.median(timings[k]) for k in ("decode", "keys", "apply", "total"))
    return IngestCost(engines, live[-1], ops, decode_s * us, keys_s * us, (apply_s - keys_s) * us,
                      max(0.0, total_s - decode_s - apply_s) * us, len(timings["total"]),
                      (min(timings["total"]) * us, max(timings["total"]) * us), replicated)


_TOTAL = re.compile(r"ops: ([0-9.]+) us")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench ingest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="16,64", help="comma-separated engine counts (default 16,64)")
    p.add_argument("--cap", type=int, default=20_000, help="live blocks per engine (default 20000)")
    p.add_argument("--steps", type=int, default=100, help="recorded steps per engine (default 100)")
    p.add_argument("--quick", action="store_true", help="16 engines, cap 5000, 40 steps")
    p.add_argument("--repeat", type=int, default=3, help="timed passes of each kind, medians reported (default 3)")
    p.add_argument("--process", action="store_true",
                   help="each side's cost with ingest_process: the serving loop and the ingest process")
    p.add_argument("--replicated", action="store_true",
                   help="every engine with a twin sent the same messages: every block held by two engines")
    p.add_argument("--zmq", type=float, metavar="RATE",
                   help="through the replica's subscribers over ZeroMQ, RATE messages/s (bench/ingest_zmq.py)")
    add_against_options(p, "code (one engine count)")
    args = p.parse_args(argv)
    counts = [16] if args.quick else [int(x) for x in args.engines.split(",") if x]
    cap, steps = (5_000, 40) if args.quick else (args.cap, args.steps)
    if args.against:
        one = ["--engines", str(counts[0]), "--cap", str(cap), "--steps", str(steps),
               *(["--zmq", str(args.zmq)] if args.zmq else []), *(["--replicated"] if args.replicated else [])]
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvmesh-bench-ingest-"))
        for line in side_by_side(args.against, args.passes, ["-m", "bench.ingest_cost", *one], _TOTAL, "us per op",
                                 log_dir):
            print(line, flush=True)
        return 0
    for count in counts:
        if args.zmq:
            print(measure_over_zmq(count, cap, steps, args.zmq), flush=True)
        elif args.process:
            print(measure_split(count, cap, steps, passes=args.repeat).line(), flush=True)
        else:
            print(measure(count, cap, steps, passes=args.repeat, replicated=args.replicated).line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
