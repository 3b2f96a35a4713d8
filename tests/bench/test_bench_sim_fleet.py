"""The measuring path end to end against real simulated engines and routers on loopback."""

from __future__ import annotations

import pytest

from bench import workloads
from bench.client import HttpClient
from bench.runner import FleetSpec, MeasureOptions, measure, routers, sim_fleet


@pytest.mark.integration
async def test_measure_reads_engine_hit_rates_and_load_from_a_sim_fleet(tmp_path):
    client = HttpClient()
    spec = FleetSpec(engines=2, profile="fast", time_scale=1.0, num_blocks=1024)
    options = MeasureOptions("b", seed=7, requests=30, max_tokens=4, timeout=30.0, warmup=2)
    try:
        async with sim_fleet(client, spec, tmp_path) as engines:
            # Straight at engine 0: every request is served there and the 5 system prompts get reused.
            row = await measure(client, "direct", engines[0], engines, 1, options, fleet=spec)
    finally:
        await client.aclose()
    assert (row.summary.requests, row.summary.errors) == (30, 0)
    assert row.engine_share == [1.0, 0.0]
    # 200-token system prompts ahead of 10-80 token user messages: most prompt tokens are cached.
    assert 0.4 < row.hit_rate < 0.95
    # One at a time, only the first request under each system prompt misses it.
    distinct = len({c.system for c in workloads.build("b", 7, 30)})
    assert (row.summary.prefix_hits, row.summary.prefix_judged) == (30 - distinct, 30)
    assert row.summary.ttft_p50 > 0 and row.summary.out_tok_per_s > 0
    assert 0 < row.ttft_floor < row.summary.ttft_p50
    # The client's TTFT holds the engine's own (its scheduler to the token) plus its HTTP front and the network.
    assert row.outside_engines_s > 0


async def measured_through(tmp_path, policy: str, replicas: int, options: MeasureOptions, after=None):
    """(the row of ``options`` sent through ``replicas`` routers of ``policy`` on a fresh 2-engine fleet, what
    ``after(urls)`` returned while they still ran)."""
    client = HttpClient()
    spec = FleetSpec(engines=2, profile="fast", time_scale=1.0, num_blocks=1024)
    try:
        async with (
            sim_fleet(client, spec, tmp_path) as engines,
            routers(client, engines, policy, replicas, tmp_path) as urls,
        ):
            row = await measure(client, policy, urls, engines, 1, options, fleet=spec)
            return row, (await after(client, urls) if after else None)
    finally:
        await client.aclose()


@pytest.mark.integration
async def test_a_policy_at_a_revision_runs_that_revisions_router(tmp_path):
    """``round_robin@HEAD``: the router runs from the revision's exported tree, beside the fleet as any other."""
    options = MeasureOptions("b", seed=7, requests=6, max_tokens=4, timeout=30.0, warmup=2)
    row, _ = await measured_through(tmp_path, "round_robin@HEAD", 1, options)
    assert (row.summary.requests, row.summary.errors) == (6, 0)
    assert sorted(row.engine_share) == [0.5, 0.5]
    assert [p.name for p in tmp_path.glob("rev-*/gateway/cli.py")] == ["cli.py"]


@pytest.mark.integration
@pytest.mark.mesh
async def test_meshed_replicas_share_the_requests_and_one_index(tmp_path):
    options = MeasureOptions("a", seed=3, requests=12, max_tokens=4, timeout=30.0, warmup=2)

    async def members_seen(client, urls):
        return [len((await client.get_json(u + "/admin/mesh"))["members"]) for u in urls]

    row, members = await measured_through(tmp_path, "kv_aware", 2, options, members_seen)
    assert members == [2, 2] and row.routers == 2
    assert row.summary.errors == 0 and row.summary.prefix_judged == row.summary.requests
    # Each replica routes the other's primed documents to where they are: a cache-blind choice
    # between two engines would find about half of them.
    assert row.summary.request_hit_rate >= 0.75
