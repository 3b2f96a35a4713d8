"""``kvmesh bench pd``: prefill/decode disaggregation side by side on one simulated fleet, in one run.

Four simulated engines (a process each), three setups in front of them: kvmesh with two prefill and two
decode engines (handoff protocol), kvmesh with the four serving whole requests, and the same P/D split with
round-robin choices (each role's engines taken in turn, no index). Caches are reset before each measurement,
and the whole comparison is repeated ``--rounds`` times. Prints TTFT and inter-token latency percentiles,
output throughput and why requests skipped the prefill leg, then judges the two claims in each round and
over all rounds (P/D's ITL p99 at the top concurrency; kvmesh's P choice vs round robin on TTFT p50), and
draws TTFT and ITL against concurrency (PNG).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path

import trio

from bench.client import TRANSPORT_ERRORS, HttpClient
from bench.engine_stats import HITS, QUERIES, parse_counters
from bench.pd_workload import PdRow, PdWorkload, StreamTimes, format_rows, medians, summarize, verdicts
from bench.processes import StartFailed
from bench.runner import FleetSpec, router, sim_fleet
from bench.sse import SseSplitter, StreamedAnswer

SPLIT = ("prefill", "prefill", "decode", "decode")
SETUPS = (("kvmesh P/D", "kv_aware", SPLIT), ("kvmesh aggregated", "kv_aware", ("both",) * 4),
          ("round-robin P/D", "round_robin", SPLIT))
MODEL = "kvmesh-tiny"


def router_config(path: Path, urls: list[str], roles: tuple[str, ...]) -> Path:
    lines = ["metrics_interval_s = 0.2", "first_byte_timeout_s = 600", "[pd]", "min_prefill_tokens = 512"]
    for url, role in zip(urls, roles, strict=True):
        lines += ["[[engines]]", f'url = "{url}"', f'role = "{role}"']
    path.write_text("\n".join(lines) + "\n")
    return path


async def all_routable(client: HttpClient, url: str, engines: int) -> None:
    """A router is ready once one engine is; a comparison starts once it routes to all of them."""
    with trio.fail_after(60):
        while True:
            listing = await client.get_json(url + "/admin/engines")
            up = [e for e in listing["engines"] if e["healthy"] and e["models"]]  # type: ignore[index]
            if len(up) == engines:
                return
            await trio.sleep(0.1)


async def prefix_counters(client: HttpClient, urls: list[str]) -> tuple[float, float]:
    """Prefix-cache (hits, queried tokens) summed over engines: how much prefill the choice of engine saved."""
    hits = queries = 0.0
    for url in urls:
        counts = parse_counters((await client.request(url + "/metrics")).body.decode(), (HITS, QUERIES))
        hits, queries = hits + counts[HITS], queries + counts[QUERIES]
    return hits, queries


async def skip_counts(client: HttpClient, url: str) -> dict[str, int]:
    text = (await client.request(url + "/metrics")).body.decode()
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("kvmesh_pd_requests_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            counts[outcome] = int(float(line.rsplit(" ", 1)[1]))
    return counts


async def streamed(client: HttpClient, url: str, body: dict, timeout: float) -> StreamTimes:
    times = StreamTimes()
    answer, splitter = StreamedAnswer(), SseSplitter()
    start = trio.current_time()

    def on_chunk(chunk: bytes) -> None:
        for payload in splitter.feed(chunk):
            before = answer.content_chunks
            answer.apply(payload)
            if answer.content_chunks > before:
                times.tokens.append(trio.current_time() - start)

    with trio.move_on_after(timeout):
        try:
            response = await client.request(url + "/v1/chat/completions", "POST", json.dumps(body).encode(),
                                            on_chunk)
            times.ok = response.status == 200 and answer.done and not answer.error
        except TRANSPORT_ERRORS:
            pass
    times.output_tokens = answer.output_tokens
    return times


async def closed_loop(client: HttpClient, url: str, bodies: list[dict], concurrency: int, timeout: float
                      ) -> tuple[list[StreamTimes], float]:
    queue = list(reversed(bodies))
    results: list[StreamTimes] = []

    async def worker() -> None:
        while queue:
            results.append(await streamed(client, url, queue.pop(), timeout))

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return results, trio.current_time() - start


async def reset_caches(client: HttpClient, urls: list[str]) -> None:
    for url in urls:
        await client.request(url + "/reset_prefix_cache", "POST", b"")
    await trio.sleep(0.5)  # the engines clear at their next step; the routers' indexes follow their events


async def measure(client: HttpClient, url: str, urls: list[str], roles: tuple[str, ...], bodies: list[dict],
                  concurrency: int, timeout: float) -> tuple[list[StreamTimes], float, dict[str, int], float]:
    """One closed-loop measurement from cold caches: the streams, the wall time, why requests skipped the
    prefill leg, and the share of prompt tokens the prefilling engines served from cache."""
    await reset_caches(client, urls)
    prefilling = [u for u, role in zip(urls, roles, strict=True) if role != "decode"]
    before, counted = await skip_counts(client, url), await prefix_counters(client, prefilling)
    runs, wall = await closed_loop(client, url, bodies, concurrency, timeout)
    after, (hits, queries) = await skip_counts(client, url), await prefix_counters(client, prefilling)
    skipped = {k.removeprefix("skipped_"): after[k] - before.get(k, 0) for k in after
               if k != "disaggregated" and after[k] - before.get(k, 0)}
    return runs, wall, skipped, (hits - counted[0]) / max(queries - counted[1], 1.0)


async def run(args: argparse.Namespace, log_dir: Path) -> list[PdRow]:
    client = HttpClient()
    spec = FleetSpec(engines=1, profile=args.profile, time_scale=args.time_scale, num_blocks=args.num_blocks,
                     max_num_seqs=args.max_num_seqs)
    workload = PdWorkload(documents=args.documents, doc_tokens=(args.doc_min, args.doc_max), seed=args.seed)
    docs = workload.docs()
    rows: list[PdRow] = []
    # One process per engine, as vLLM runs: a simulated engine's own CPU (tokenizing and hashing a 16k-token
    # prompt) stalls every engine of its process, and with two decode engines in one process each stall hit
    # twice the streams it hits in the aggregated fleet.
    async with AsyncExitStack() as stack:
        urls = [url for _ in SPLIT for url in await stack.enter_async_context(sim_fleet(client, spec, log_dir))]
        for turn in range(args.rounds):
            # Each round starts every setup's router afresh (nothing learned carries over) and takes the setups
            # in a rotated order, so a machine that slows down over the run does not favour one of them.
            for name, policy, roles in SETUPS[turn % 3:] + SETUPS[:turn % 3]:
                config = router_config(log_dir / f"router-{policy}-{roles[0]}.toml", urls, roles)
                async with router(client, [], policy, log_dir, extra_args=["--config", str(config)]) as url:
                    await all_routable(client, url, len(urls))
                    for concurrency in args.concurrency:
                        count = args.requests or max(12, 3 * concurrency)
                        bodies = workload.requests(count, docs, MODEL, offset=turn * 100_000 + concurrency * 1000)
                        runs, wall, skipped, hit_rate = await measure(client, url, urls, roles, bodies, concurrency,
                                                                      args.timeout)
                        row = summarize(name, concurrency, runs, wall, skipped, hit_rate, turn)
                        print(format_rows([row]).splitlines()[1], file=sys.stderr, flush=True)
                        rows.append(row)
    return rows


def plot(rows: list[PdRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft, itl) = plt.subplots(1, 2, figsize=(11, 4))
    by = medians(rows)
    for name, _, _ in SETUPS:
        cs = sorted(c for setup, c in by if setup == name)
        ttft.plot(cs, [by[name, c][0] * 1e3 for c in cs], marker="o", label=f"{name} p50")
        ttft.plot(cs, [by[name, c][1] * 1e3 for c in cs], marker="x", linestyle="--", label=f"{name} p99")
        itl.plot(cs, [by[name, c][2] * 1e3 for c in cs], marker="o", label=f"{name} p50")
        itl.plot(cs, [by[name, c][3] * 1e3 for c in cs], marker="x", linestyle="--", label=f"{name} p99")
    for axis, title in ((ttft, "time to first token (ms)"), (itl, "inter-token latency (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("concurrency")
        axis.set_title(f"{title}, median of rounds")
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh bench pd", description=__doc__)
    p.add_argument("--concurrency", type=lambda t: [int(x) for x in t.split(",") if x], default=[1, 8, 32])
    p.add_argument("--requests", type=int, help="per concurrency level (default max(12, 3 x concurrency))")
    p.add_argument("--documents", type=int, default=6, help="shared documents the prompts start with")
    p.add_argument("--doc-min", type=int, default=4096, help="shortest document, tokens")
    p.add_argument("--doc-max", type=int, default=32768, help="longest document, tokens")
    p.add_argument("--profile", default="a40-qwen1.5b")
    p.add_argument("--time-scale", type=float, default=0.5)
    p.add_argument("--num-blocks", type=int, default=24576, help="KV blocks per engine")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="repeat the whole comparison, setups in rotated order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--png", type=Path, default=Path("bench-pd.png"))
    p.add_argument("--log-dir", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvmesh-bench-pd-"))
    print(f"process logs: {log_dir}", file=sys.stderr)
    try:
        rows = trio.run(run, args, log_dir)
    except StartFailed as exc:
        print(f"kvmesh bench pd: {exc}", file=sys.stderr)
        return 2
    print(format_rows(rows))
    for line in verdicts(rows):
        print(line)
    plot(rows, args.png)
    print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
