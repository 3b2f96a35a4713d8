"""What the router adds: the same requests sent to one engine directly and through the router.

Two workloads. ``tiny``: small unique prompts, direct and routed blocks alternating (A B B A ...).
``system``: a 1,500-token system prompt every request shares plus a fresh user turn, streamed, the
shape where a router's own cost sits next to a cached prefill; engine, kvmesh and peer routers (smg)
take turns in each round so machine noise hits all alike, and each router's cost is taken against the
engine's numbers from the same round.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from bench.client import HttpClient, model_name, run_closed_loop
from bench.engine_stats import ENGINE_TTFT, ScrapeResult, delta, mean_engine_ttft, scrape
from bench.passthrough import passthrough_relay
from bench.peers import smg_router
from bench.replica_stats import process_cpu, process_run_wait
from bench.revision import exported, is_revision_peer, split_peer
from bench.runner import FleetSpec, router, sim_fleet
from bench.stats import RequestResult, Summary, percentile, summarize
from bench.workloads import Conversation, text, unique_prompts


@dataclass
class OverheadRow:
    path: str
    stream: bool
    summary: Summary


def block_order(rounds: int) -> list[str]:
    """ABBA ordering: each side goes first equally often, cancelling drift within the run."""
    order = []
    for r in range(rounds):
        order += ["direct", "router"] if r % 2 == 0 else ["router", "direct"]
    return order


async def measure_overhead(
    spec: FleetSpec,
    log_dir: Path,
    concurrency: int = 8,
    requests: int = 200,
    rounds: int = 4,
    policy: str = "kv_aware",
) -> list[OverheadRow]:
    """Closed-loop blocks of ``requests`` tiny prompts, non-streaming and streaming, both paths."""
    client = HttpClient()
    collected: dict[tuple[str, bool], tuple[list[RequestResult], float]] = {}
    try:
        async with sim_fleet(client, spec, log_dir) as engines, router(client, engines, policy, log_dir) as url:
            targets = {"direct": engines[0], "router": url}
            model = await model_name(client, engines[0])
            for i, path in enumerate(block_order(rounds)):
                for stream in (False, True):
                    convs = unique_prompts(seed=1 + 2 * i + stream, count=requests, tokens=16, max_tokens=4)
                    results, wall = await run_closed_loop(client, targets[path], convs, concurrency, model, stream)
                    done, total_wall = collected.get((path, stream), ([], 0.0))
                    collected[(path, stream)] = (done + results, total_wall + wall)
    finally:
        await client.aclose()
    return [OverheadRow(p, s, summarize(res, wall)) for (p, s), (res, wall) in sorted(collected.items())]


def format_overhead(rows: list[OverheadRow]) -> str:
    """Per mode: both paths' numbers and the router's added p50/p99 latency and throughput ratio."""
    lines = [f"{'mode':<10} {'path':<7} {'reqs':>5} {'errs':>4} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}"]
    by_key = {(r.path, r.stream): r.summary for r in rows}
    for stream in (False, True):
        mode = "stream" if stream else "plain"
        for path in ("direct", "router"):
            s = by_key.get((path, stream))
            if s:
                lines.append(
                    f"{mode:<10} {path:<7} {s.requests:>5} {s.errors:>4} {s.req_per_s:>8.1f} "
                    f"{s.latency_p50 * 1000:>8.2f} {s.latency_p99 * 1000:>8.2f}"
                )
        direct, routed = by_key.get(("direct", stream)), by_key.get(("router", stream))
        if direct and routed and direct.req_per_s:
            lines.append(
                f"{mode:<10} router adds p50 {(routed.latency_p50 - direct.latency_p50) * 1000:+.2f} ms, "
                f"p99 {(routed.latency_p99 - direct.latency_p99) * 1000:+.2f} ms, "
                f"req/s x{routed.req_per_s / direct.req_per_s:.2f}"
            )
    return "\n".join(lines)


# --- The overhead workload: a long system prompt every request shares, a fresh user turn, streamed. ---

SYSTEM_WORDS = 1_500
USER_WORDS = 300
LONG_USER_WORDS = 8_000
ANSWER_TOKENS = 16


@dataclass(frozen=True)
class Case:
    """One measured shape: concurrency, fresh user-turn length and requests per block."""

    name: str
    concurrency: int
    user_words: int
    requests: int
    answer_tokens: int = ANSWER_TOKENS


def system_prompt_cases(c1_requests: int = 40, c64_requests: int = 256) -> list[Case]:
    return [
        Case("c=1", 1, USER_WORDS, c1_requests),
        Case("c=1 8k", 1, LONG_USER_WORDS, max(4, c1_requests // 2)),
        Case("c=64", 64, USER_WORDS, c64_requests),
    ]


def system_prompt_requests(seed: int, count: int, user_words: int,
                           answer_tokens: int = ANSWER_TOKENS) -> list[Conversation]:
    """``count`` requests sharing one fixed system prompt, each with a user turn no other request has."""
    system = text(random.Random("overhead-system"), SYSTEM_WORDS)
    rng = random.Random(f"overhead-user-{seed}")
    return [Conversation(f"s{seed}-{i}", [f"Question {seed}-{i}:" + text(rng, user_words)], answer_tokens, system)
            for i in range(count)]


def with_answer_lengths(cases: list[Case], lengths: list[int]) -> list[Case]:
    """Each case once per answer length, the default length under the case's own name and any other as
    ``NAME aN`` (N tokens): the same streams with longer answers show what a router pays per relayed token."""
    return [case if n == ANSWER_TOKENS else replace(case, name=case.name + answer_suffix(n), answer_tokens=n)
            for case in cases for n in dict.fromkeys(lengths)]


def answer_suffix(tokens: int) -> str:
    """What a case's name gains for answers of ``tokens`` (none for the default length)."""
    if tokens == ANSWER_TOKENS:
        return ""
    return f" a{tokens}"


def rotated(paths: list[str], round_index: int) -> list[str]:
    """Each round starts with the next path, so none always runs first (or right after a warm-up)."""
    k = round_index % len(paths)
    return paths[k:] + paths[:k]


@dataclass
class Block:
    """One path's closed-loop block of one case in one round."""

    path: str
    case: str
    round: int
    results: list[RequestResult]
    wall: float
    cpu_s: float | None = None
    """CPU time of the path's own process (a router, not the engine) during the block."""
    engine_cpu_s: float | None = None
    """CPU time of the engine's process during the block, whichever path sent the requests."""
    engine_ttft_s: float | None = None
    """The engine's own mean TTFT over the block (its /metrics histogram: scheduler arrival to first token)."""
    engine_wait_s: float | None = None
    """Time the engine's threads were runnable but got no core (the kernel's run queue) during the block."""
    wait_s: float | None = None
    """The same for the path's own process (a router): on a shared machine, other work takes its core."""

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.ok if r.ttft is not None]

    def ttft(self, q: float) -> float:
        return percentile(self.ttfts, q)

    def mean_ttft(self) -> float:
        """In a closed loop the mean is what holding or reordering requests cannot move (each stream's TTFT
        plus the rest of its answer is streams / req/s): it tells a lower median from a reordered one."""
        ttfts = self.ttfts
        return statistics.fmean(ttfts) if ttfts else math.nan

    @property
    def req_per_s(self) -> float:
        return len(self.ok) / self.wall if self.wall > 0 else 0.0


PEERS = ("smg", "passthrough")
"""``passthrough`` is not a router: it is kvmesh's own HTTP stack relaying to the engine and nothing else
(bench/passthrough.py), the floor under kvmesh's row. ``kvmesh@REV`` and ``passthrough@REV`` run the code of
git revision REV beside this one's (``bench.revision``): a change's before and after in one run."""
QUEUE_THRESHOLD = 1024
"""kvmesh sheds load (429) once an engine's queue passes its threshold, 64 by default; the peer does not, and
at c=64 on one engine the default sheds. The bench compares data paths, so shedding is kept out of it."""
PEER_POLICY = "cache_aware"


def known_peer(name: str) -> bool:
    """A peer ``--peers`` may name: smg, the floor, or kvmesh or the floor at another git revision."""
    return name in PEERS or is_revision_peer(name)


@asynccontextmanager
async def _paths(client: HttpClient, spec: FleetSpec, log_dir: Path, policy: str, peer_names: list[str],
                 pids: dict[str, int], engine_pids: dict[str, int],
                 router_cores: frozenset[int] | None) -> AsyncIterator[dict[str, str]]:
    """One engine, kvmesh in front of it, and each peer in front of the same engine (the routers on
    ``router_cores`` when given); each router's pid goes into ``pids`` by URL, the engine's into
    ``engine_pids``."""
    async with AsyncExitStack() as stack:
        engines = await stack.enter_async_context(sim_fleet(client, spec, log_dir, engine_pids))
        config = log_dir / "overhead-router.toml"
        config.write_text(f"[admission]\nqueue_threshold = {QUEUE_THRESHOLD}\n")
        kvmesh = await stack.enter_async_context(router(client, engines, policy, log_dir, pids=pids,
                                                        extra_args=["--config", str(config)], cores=router_cores))
        urls = {"engine": engines[0], "kvmesh": kvmesh}
        for name in peer_names:
            base, revision = split_peer(name)
            root = exported(revision, log_dir) if revision else None
            if base == "kvmesh":
                start = router(client, engines, policy, log_dir, pids=pids, extra_args=["--config", str(config)],
                               cores=router_cores, root=root)
            elif base == "passthrough":
                start = passthrough_relay(client, engines[0], log_dir, pids, router_cores, root)
            else:
                start = smg_router(client, engines, f"smg:{PEER_POLICY}", log_dir, pids, router_cores)
            urls[name] = await stack.enter_async_context(start)
        yield urls


async def measure_system_prompt(spec: FleetSpec, log_dir: Path, rounds: int = 5, policy: str = "kv_aware",
                                peer_names: list[str] | None = None, cases: list[Case] | None = None,
                                router_cores: frozenset[int] | None = None) -> list[Block]:
    """Interleaved rounds: in each, every case runs on every path (engine, kvmesh, peers) in rotated order.
    Around each block the engine's CPU time and its own TTFT histogram are read as well: every path shares
    the one engine, so a path that changes the engine's own work or queueing shows there, apart from what
    the path itself adds."""
    client = HttpClient()
    cases = cases or system_prompt_cases()
    blocks: list[Block] = []
    pids: dict[str, int] = {}
    engine_pids: dict[str, int] = {}
    try:
        async with _paths(client, spec, log_dir, policy, peer_names or [], pids, engine_pids,
                          router_cores) as urls:
            engine_url = urls["engine"]
            model = await model_name(client, urls["engine"])
            for url in urls.values():  # warm-up: the system prompt cached, connections open
                await run_closed_loop(client, url, system_prompt_requests(10_000, 8, USER_WORDS), 4, model, True)
            seed = 0
            for rnd in range(rounds):
                for case in cases:
                    for path in rotated(list(urls), rnd):
                        seed += 1
                        convs = system_prompt_requests(seed, case.requests, case.user_words, case.answer_tokens)
                        pid, engine_pid = pids.get(urls[path]), engine_pids[engine_url]
                        seen_before = await scrape(client, [engine_url], names=ENGINE_TTFT)
                        before = _process_times(pid), _process_times(engine_pid)
                        results, wall = await run_closed_loop(client, urls[path], convs, case.concurrency, model, True)
                        (cpu, wait), (engine_cpu, engine_wait) = (
                            _since(before[0], _process_times(pid)), _since(before[1], _process_times(engine_pid)))
                        own_ttft = _engine_ttft(seen_before, await scrape(client, [engine_url], names=ENGINE_TTFT))
                        blocks.append(Block(path, case.name, rnd, results, wall, cpu, engine_cpu, own_ttft,
                                            engine_wait, wait))
    finally:
        await client.aclose()
    return blocks


def _process_times(pid: int | None) -> tuple[float, float] | None:
    """(CPU time, run-queue wait) of a process so far; None for a path without a process of its own."""
    return (process_cpu(pid), process_run_wait(pid)) if pid else None


def _since(before: tuple[float, float] | None, after: tuple[float, float] | None) -> tuple[float | None, float | None]:
    if before is None or after is None:
        return None, None
    return after[0] - before[0], after[1] - before[1]


def _engine_ttft(before: ScrapeResult, after: ScrapeResult) -> float | None:
    """The engine's own mean TTFT between two scrapes; None when either failed or no first token came."""
    if before.snapshots[0] is None or after.snapshots[0] is None:
        return None
    mean = mean_engine_ttft(delta(before.snapshots[0], after.snapshots[0]))
    return None if math.isnan(mean) else mean


def path_blocks(blocks: list[Block], case: str, path: str) -> list[Block]:
    return [b for b in blocks if b.case == case and b.path == path]


def added_ms(blocks: list[Block], case: str, path: str, q: float) -> list[float]:
    """Per round: what ``path`` adds to the engine's TTFT percentile ``q`` in the same round, in ms."""
    base = {b.round: b for b in path_blocks(blocks, case, "engine")}
    return [(b.ttft(q) - base[b.round].ttft(q)) * 1e3 for b in path_blocks(blocks, case, path)]


def speed_ratios(blocks: list[Block], case: str, path: str) -> list[float]:
    """Per round: ``path``'s req/s over the engine's in the same round."""
    base = {b.round: b for b in path_blocks(blocks, case, "engine")}
    return [b.req_per_s / base[b.round].req_per_s for b in path_blocks(blocks, case, path) if base[b.round].req_per_s]


def _path_width(blocks: list[Block]) -> int:
    """The path column fits the longest path name (another revision's is ``kvmesh@REV``)."""
    return max([11, *(len(b.path) for b in blocks)])


def _case_width(blocks: list[Block]) -> int:
    """The case column fits the longest case name (a longer answer's is ``c=16 a256``)."""
    return max([8, *(len(b.case) for b in blocks)])


def format_system_prompt(blocks: list[Block]) -> str:
    """Per case and path: pooled TTFT p50/p90/mean and req/s, then the medians over rounds of what each router
    adds to the engine's TTFT p50/p90 and of its req/s ratio to the engine's (both from the same round),
    and the router process's CPU time per answered request."""
    w, cw = _path_width(blocks), _case_width(blocks)
    lines = [f"{'case':<{cw}} {'path':<{w}} {'reqs':>5} {'errs':>4} {'TTFT p50':>9} {'p90':>7} {'mean':>9} "
             f"{'req/s':>7} {'added p50':>10} {'added p90':>10} {'req/s x':>8} {'spread p50':>11} {'CPU/req':>8}"]
    for case in dict.fromkeys(b.case for b in blocks):
        for path in dict.fromkeys(b.path for b in blocks):
            mine = path_blocks(blocks, case, path)
            pooled = _pooled(mine)
            errors = len(pooled.results) - len(pooled.ok)
            row = (f"{case:<{cw}} {path:<{w}} {len(pooled.results):>5} {errors:>4} {pooled.ttft(50) * 1e3:>7.2f}ms "
                   f"{pooled.ttft(90) * 1e3:>5.2f}ms {pooled.mean_ttft() * 1e3:>7.2f}ms "
                   f"{statistics.median(b.req_per_s for b in mine):>7.1f}")
            if path != "engine":
                added50, added90 = added_ms(blocks, case, path, 50), added_ms(blocks, case, path, 90)
                row += (f" {statistics.median(added50):>+8.2f}ms {statistics.median(added90):>+8.2f}ms "
                        f"{statistics.median(speed_ratios(blocks, case, path)):>8.2f} "
                        f"{min(added50):>+5.1f}..{max(added50):<+5.1f}")
                cpu = _cpu_per_answer(mine)
                if cpu is not None:
                    row += f" {cpu * 1e3:>6.2f}ms"
            lines.append(row)
    lines.append("added = median over rounds of (path - engine, same round); req/s x = median of per-round ratios;"
                 " spread = per-round range of added p50 (noise); CPU/req = the router process's CPU time per"
                 " answered request (its background work included)")
    return "\n".join(lines)


def _cpu_per_answer(blocks: list[Block]) -> float | None:
    """The path process's CPU time per answered request over the blocks that timed it."""
    timed = [(b.cpu_s, len(b.ok)) for b in blocks if b.cpu_s is not None]
    answered = sum(n for _, n in timed)
    return sum(cpu for cpu, _ in timed) / answered if answered else None


def _mean_output_tokens(blocks: list[Block]) -> float | None:
    counts = [r.output_tokens for b in blocks for r in b.ok if r.output_tokens]
    return statistics.fmean(counts) if counts else None


def format_answer_cost(blocks: list[Block], cases: list[Case]) -> str:
    """For each case run with longer answers (``with_answer_lengths``): each router's CPU per relayed answer
    token, from the difference in CPU per request between the longer and the default answers over the
    difference in tokens the engine reported, and each router's over smg's; empty without such cases."""
    lines = []
    for case in cases:
        if case.answer_tokens == ANSWER_TOKENS:
            continue
        base = case.name.removesuffix(answer_suffix(case.answer_tokens))
        per_token: dict[str, float] = {}
        for path in dict.fromkeys(b.path for b in blocks if b.path != "engine"):
            long, short = path_blocks(blocks, case.name, path), path_blocks(blocks, base, path)
            long_cpu, short_cpu = _cpu_per_answer(long), _cpu_per_answer(short)
            long_tokens, short_tokens = _mean_output_tokens(long), _mean_output_tokens(short)
            if long_cpu is None or short_cpu is None or long_tokens is None or short_tokens is None:
                continue
            if long_tokens > short_tokens:
                per_token[path] = (long_cpu - short_cpu) / (long_tokens - short_tokens)
        if not per_token:
            continue
        smg = per_token.get("smg")
        shown = [f"{path} {us * 1e6:.1f} us" + (f" ({us / smg:.2f}x smg)" if smg and path != "smg" else "")
                 for path, us in per_token.items()]
        lines.append(f"{base:<8} CPU per relayed answer token ({ANSWER_TOKENS} -> {case.answer_tokens} tokens): "
                     + ", ".join(shown))
    return "\n".join(lines)


def cpu_per_request(block: Block) -> float | None:
    return block.cpu_s / len(block.ok) if block.cpu_s is not None and block.ok else None


def format_revision_comparison(blocks: list[Block]) -> str:
    """For each ``X@REV`` path: per round, X's CPU per request over X@REV's and X's TTFT p50 minus X@REV's
    (the same case and round, so the same machine load within a few seconds), and the TTFT p50 of all X's
    requests minus all X@REV's: the two codes compared directly, without the engine's block between them,
    whose own noise is larger than a millisecond at c=1; empty without such paths."""
    lines = []
    for case in dict.fromkeys(b.case for b in blocks):
        for other in dict.fromkeys(b.path for b in blocks if is_revision_peer(b.path)):
            base = split_peer(other)[0]
            then = {b.round: b for b in path_blocks(blocks, case, other)}
            now = [b for b in path_blocks(blocks, case, base) if b.round in then]
            ratios = [f"{mine / old:.2f}" for b in now
                      if (mine := cpu_per_request(b)) is not None and (old := cpu_per_request(then[b.round]))]
            if ratios:
                lines.append(f"{case:<8} CPU/req {base} / {other} per round: {' '.join(ratios)}")
            gaps = [(b.ttft(50) - then[b.round].ttft(50)) * 1e3 for b in now if b.ok and then[b.round].ok]
            if gaps:
                pooled = (_pooled(now).ttft(50) - _pooled(list(then.values())).ttft(50)) * 1e3
                lines.append(f"{case:<8} TTFT p50 {base} - {other}: median of {len(gaps)} rounds "
                             f"{statistics.median(gaps):+.2f} ms (range {min(gaps):+.1f}..{max(gaps):+.1f}), "
                             f"all requests {pooled:+.2f} ms")
    return "\n".join(lines)


def _pooled(blocks: list[Block]) -> Block:
    """One path's blocks of one case as one block (every request, the summed wall time)."""
    results = [r for b in blocks for r in b.results]
    return Block(blocks[0].path, blocks[0].case, -1, results, sum(b.wall for b in blocks))


def _share(blocks: list[Block], seconds: Callable[[Block], float | None]) -> str:
    shares = [s / b.wall for b in blocks if (s := seconds(b)) is not None and b.wall > 0]
    return f"{statistics.median(shares):>15.0%}" if shares else f"{'-':>15}"


def format_engine_view(blocks: list[Block]) -> str:
    """Per case and path, what the one engine did while that path sent it the requests: its own mean TTFT
    (median over rounds), its CPU time per answered request and the share of its core it used. A router
    that made the engine slower (more work per request, polls, a worse arrival order) shows here, apart
    from its own added TTFT; an engine near 100% of its core is the bottleneck, and its TTFT is then
    mostly its own queueing."""
    w, cw = _path_width(blocks), _case_width(blocks)
    lines = [f"{'case':<{cw}} {'path':<{w}} {'engine own TTFT mean':>21} {'engine CPU/req':>15} "
             f"{'engine core busy':>17} {'engine no core':>15} {'router no core':>15}"]
    for case in dict.fromkeys(b.case for b in blocks):
        for path in dict.fromkeys(b.path for b in blocks):
            mine = [b for b in path_blocks(blocks, case, path) if b.engine_cpu_s is not None]
            ttfts = [b.engine_ttft_s for b in mine if b.engine_ttft_s is not None]
            answered = sum(len(b.ok) for b in mine)
            if not mine or not answered:
                continue
            busy = statistics.median((b.engine_cpu_s or 0.0) / b.wall for b in mine if b.wall > 0)
            own = f"{statistics.median(ttfts) * 1e3:>19.1f}ms" if ttfts else f"{'-':>21}"
            lines.append(f"{case:<{cw}} {path:<{w}} {own} "
                         f"{sum(b.engine_cpu_s or 0.0 for b in mine) / answered * 1e3:>13.2f}ms {busy:>16.0%} "
                         f"{_share(mine, lambda b: b.engine_wait_s)} {_share(mine, lambda b: b.wait_s)}")
    lines.append("engine own TTFT = median over rounds of the engine's /metrics TTFT mean in the block (arrival in"
                 " its scheduler to the first token); CPU/req = the engine process's CPU time per answered request;"
                 " no core = median share of the block's wall time the process was runnable and waited for a CPU"
                 " (its threads summed): other work on the machine")
    return "\n".join(lines)
