"""``kvmesh bench overhead --pin``: what each router adds to time to first token as the streams per replica
grow, measured as a user deploys a router: the router under test alone on a core, the engine and the load
generator on the others.

Every router (kvmesh, the passthrough floor, smg) gets the same core, one at a time, in rotated order
within each round; the engine's own block in the same round is the baseline. Concurrency sweeps 16, 64,
128 and 256 streams by default; each block sends four requests per stream (two with ``--short``).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from bench.overhead import ANSWER_TOKENS, USER_WORDS, Block, Case, added_ms, answer_suffix, path_blocks
from bench.runner import FleetSpec

SWEEP = (16, 64, 128, 256)
JUDGED_FROM = 64
"""The targets hold from this concurrency up: at most the peer's added TTFT p50 + 10 ms and p90 + 20 ms,
and at least its req/s."""
P50_MARGIN_MS = 10.0
P90_MARGIN_MS = 20.0
PEER = "smg"


@dataclass(frozen=True)
class Pinning:
    router: frozenset[int]
    """The CPUs of the router under test."""
    rest: frozenset[int]
    """The CPUs of the engine and the load generator (this process)."""


def split_cores(available: set[int]) -> Pinning:
    """The highest-numbered CPU for the router under test, the others for the engine and the load."""
    if len(available) < 2:
        raise SystemExit("kvmesh bench overhead --pin: needs at least 2 CPUs (one of them for the router alone)")
    top = max(available)
    return Pinning(frozenset({top}), frozenset(available - {top}))


def pin_this_process() -> Pinning:
    """Move this process (the load generator, and the engine it starts next) off the router's CPU."""
    pinning = split_cores(os.sched_getaffinity(0))
    os.sched_setaffinity(0, pinning.rest)
    return pinning


def load_average() -> str:
    """The machine's load average, printed with the sweep: on a shared machine other work takes the cores
    the pinning promised, and the numbers are read with it."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def fleet_for_sweep(spec: FleetSpec, concurrencies: list[int]) -> FleetSpec:
    """The engine admits every stream of the widest case at once, as a vLLM replica sized for that load
    would (vLLM's default is 256 sequences): with 64 slots, 192 of 256 streams would wait in the engine's
    queue, and their TTFT would be the queue's order, not the router's cost."""
    return replace(spec, max_num_seqs=max(spec.max_num_seqs, *concurrencies))


def sweep_cases(concurrencies: list[int], short: bool, c1_requests: int | None = None) -> list[Case]:
    """c=1 (the latency floor, kept as a check) and one case per swept concurrency. ``c1_requests`` sets
    the c=1 block's size: small blocks over many rounds put two codes' requests closer together in time,
    which a 1 ms comparison at c=1 needs on a machine whose load moves by more than that within a block."""
    per_stream = 2 if short else 4
    return [Case("c=1", 1, USER_WORDS, c1_requests or (20 if short else 40)),
            *(Case(f"c={c}", c, USER_WORDS, per_stream * c) for c in concurrencies if c > 1)]


def _median_req_per_s(blocks: list[Block], case: str, path: str) -> float:
    return statistics.median(b.req_per_s for b in path_blocks(blocks, case, path))


def verdicts(blocks: list[Block], concurrencies: list[int]) -> list[str]:
    """kvmesh against the peer at each judged concurrency, from this run's blocks."""
    paths = {b.path for b in blocks}
    if PEER not in paths:
        return [f"no {PEER} in this run: targets not judged (install it and set SMG_BINARY)"]
    if not any(b.case == f"c={c}" for b in blocks for c in concurrencies):
        return [f"no {ANSWER_TOKENS}-token answers in this run: targets not judged (they are set at that length)"]
    lines = []
    for c in (c for c in concurrencies if c >= JUDGED_FROM):
        case = f"c={c}"
        mine = {q: statistics.median(added_ms(blocks, case, "kvmesh", q)) for q in (50, 90)}
        peer = {q: statistics.median(added_ms(blocks, case, PEER, q)) for q in (50, 90)}
        rate, peer_rate = _median_req_per_s(blocks, case, "kvmesh"), _median_req_per_s(blocks, case, PEER)
        ok = (mine[50] <= peer[50] + P50_MARGIN_MS and mine[90] <= peer[90] + P90_MARGIN_MS and rate >= peer_rate)
        lines.append(f"{case:<6} {'PASS' if ok else 'FAIL'}  added p50 {mine[50]:+.1f} ms (smg {peer[50]:+.1f}, "
                     f"limit {peer[50] + P50_MARGIN_MS:+.1f}), p90 {mine[90]:+.1f} ms (smg {peer[90]:+.1f}, limit "
                     f"{peer[90] + P90_MARGIN_MS:+.1f}), req/s {rate:.1f} (smg {peer_rate:.1f})")
    return lines


def plot(blocks: list[Block], concurrencies: list[int], lengths: list[int], path: Path) -> None:
    """Added TTFT p50 (solid) and p90 (dashed) against concurrency, one colour per router and one marker per answer
    length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    routers = [p for p in dict.fromkeys(b.path for b in blocks) if p != "engine"]
    for i, router in enumerate(routers):
        for length, marker in zip(dict.fromkeys(lengths), "osD^v<>", strict=False):
            suffix = answer_suffix(length)
            for q, style in ((50, "-"), (90, "--")):
                ys = [statistics.median(added_ms(blocks, f"c={c}{suffix}", router, q)) for c in concurrencies]
                ax.plot(concurrencies, ys, style, marker=marker, color=f"C{i}", label=f"{router} p{q}{suffix}")
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set_xlabel("concurrent streams (router alone on a core)")
    ax.set_ylabel("added TTFT over the engine (ms, median over rounds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
