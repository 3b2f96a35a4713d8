"""The measuring path end to end against real simulated engines on loopback."""

from __future__ import annotations

import pytest

from bench.client import HttpClient
from bench.runner import FleetSpec, MeasureOptions, measure, sim_fleet


@pytest.mark.integration
async def test_measure_reads_engine_hit_rate_and_load_from_a_sim_fleet(tmp_path):
    client = HttpClient()
    spec = FleetSpec(engines=2, profile="fast", time_scale=1.0, num_blocks=1024)
    options = MeasureOptions("b", seed=7, requests=30, max_tokens=4, timeout=30.0, warmup=2)
    try:
        async with sim_fleet(client, spec, tmp_path) as engines:
            # Straight at engine 0: every request is served there and the 5 system prompts get reused.
            row = await measure(client, "direct", engines[0], engines, 4, options)
    finally:
        await client.aclose()
    assert (row.summary.requests, row.summary.errors) == (30, 0)
    assert row.engine_share == [1.0, 0.0]
    # 200-token system prompts ahead of 10-80 token user messages: most prompt tokens are cached.
    assert 0.4 < row.hit_rate < 0.95
    assert row.summary.ttft_p50 > 0 and row.summary.out_tok_per_s > 0
