"""The engines' own view of a run: counters from ``/metrics`` scraped before and after, then diffed.

The engine's prefix-cache counters are the ground truth for hit rate: they do not depend on what the
router believes it achieved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import trio
from prometheus_client.parser import text_string_to_metric_families

from bench.client import TRANSPORT_ERRORS, HttpClient

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
SUCCESSES = "vllm:request_success_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
COUNTERS = (HITS, QUERIES, SUCCESSES, PROMPT_TOKENS)
TTFT_SUM = "vllm:time_to_first_token_seconds_sum"
TTFT_COUNT = "vllm:time_to_first_token_seconds_count"
ENGINE_TTFT = (TTFT_SUM, TTFT_COUNT)
RUN_SAMPLES = COUNTERS + ENGINE_TTFT
"""What a measured run reads from each engine before and after it: the counters and the engine's own TTFT."""
DECISION_SUM = "kvmesh_route_decision_seconds_sum"
DECISION_COUNT = "kvmesh_route_decision_seconds_count"
ROUTER_COUNTERS = (DECISION_SUM, DECISION_COUNT)


def mean_decision_ms(deltas: list[Snapshot]) -> float:
    """A kvmesh router's mean time from a request to its ranked engines (tokenize and score), over its
    replicas; NaN for routers that do not export it (peers)."""
    count = sum(d.get(DECISION_COUNT, 0.0) for d in deltas)
    return 1e3 * sum(d.get(DECISION_SUM, 0.0) for d in deltas) / count if count > 0 else math.nan

Snapshot = dict[str, float]


def mean_engine_ttft(d: Snapshot) -> float:
    """The engine's own mean time to first token (its scheduler's arrival to the token) over a delta; NaN
    when no request got one."""
    count = d.get(TTFT_COUNT, 0.0)
    return d.get(TTFT_SUM, 0.0) / count if count > 0 else math.nan


def fleet_engine_ttft(deltas: list[Snapshot]) -> float:
    """The engines' own mean time to first token over the whole fleet (request-weighted), NaN when none got one:
    beside the client's mean TTFT it splits a policy's time into the engines' (queue, prefill) and the router's."""
    return mean_engine_ttft({TTFT_SUM: sum(d.get(TTFT_SUM, 0.0) for d in deltas),
                             TTFT_COUNT: sum(d.get(TTFT_COUNT, 0.0) for d in deltas)})


def parse_counters(text: str, names: tuple[str, ...] = COUNTERS) -> Snapshot:
    """Sum each named sample over all its label sets; unparsable exposition text raises ValueError."""
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals and math.isfinite(sample.value):
                totals[sample.name] += sample.value
    return totals


def delta(before: Snapshot, after: Snapshot) -> Snapshot:
    """Counter increase over the run; a counter that went down means the engine restarted, so the
    value after the restart is the best estimate of the increase."""
    out = {}
    for name, value in after.items():
        start = before.get(name, 0.0)
        out[name] = value - start if value >= start else value
    return out


def hit_rate(d: Snapshot) -> float:
    """Cached prompt tokens over queried prompt tokens; NaN when nothing was queried."""
    queries = d.get(QUERIES, 0.0)
    return d.get(HITS, 0.0) / queries if queries > 0 else math.nan


def fleet_hit_rate(deltas: list[Snapshot]) -> float:
    """Token-weighted hit rate of the whole fleet (not the mean of per-engine rates)."""
    return hit_rate(
        {HITS: sum(d.get(HITS, 0.0) for d in deltas), QUERIES: sum(d.get(QUERIES, 0.0) for d in deltas)}
    )


@dataclass
class ScrapeResult:
    snapshots: list[Snapshot | None]
    failures: int


async def scrape(client: HttpClient, engine_urls: list[str], timeout: float = 5.0,
                 names: tuple[str, ...] = COUNTERS) -> ScrapeResult:
    """One snapshot per engine (or router: ``names`` picks the samples), ``None`` for one that did not answer or
    answered nonsense."""
    snapshots: list[Snapshot | None] = [None] * len(engine_urls)

    async def one(i: int, url: str) -> None:
        try:
            with trio.fail_after(timeout):
                response = await client.request(url.rstrip("/") + "/metrics")
            if response.status == 200:
                snapshots[i] = parse_counters(response.body.decode("utf-8", errors="replace"), names)
        except (*TRANSPORT_ERRORS, ValueError, trio.TooSlowError):
            snapshots[i] = None

    async with trio.open_nursery() as nursery:
        for i, url in enumerate(engine_urls):
            nursery.start_soon(one, i, url)
    return ScrapeResult(snapshots, sum(s is None for s in snapshots))


def deltas(before: ScrapeResult, after: ScrapeResult) -> list[Snapshot]:
    """Per-engine deltas; an engine missing from either scrape contributes an empty delta."""
    return [
        delta(b, a) if b is not None and a is not None else {}
        for b, a in zip(before.snapshots, after.snapshots, strict=True)
    ]
