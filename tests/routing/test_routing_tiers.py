"""A prompt held in an engine's offloaded tier is priced as its load time: between a GPU hit and a miss."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, EngineConfig
from gateway.routing import CostModel, EngineView, RouteRequest, make_policy, route_table
from gateway.routing.cost import Knowledge
from gateway.tier_config import TierConfig
from index.tiers import TierRun

REQUEST = RouteRequest(model="m", prompt_tokens=1024, total_blocks=64)
CPU_BLOCK_S = TierConfig().block_load_s("CPU", 16)


def view(engine_id: str, exact: int = 0, runs: tuple = ()) -> EngineView:
    return EngineView(id=engine_id, url=f"http://{engine_id}", block_size=16, exact_blocks=exact, tier_runs=runs)


def test_cpu_tier_hit_costs_its_load_time_not_a_prefill():
    costs = CostModel()
    prefill = costs.learner.params("e", None).prefill_s
    miss = costs.estimate(REQUEST, view("miss"), Knowledge.EVENTS)
    gpu = costs.estimate(REQUEST, view("gpu", exact=64), Knowledge.EVENTS)
    cpu = costs.estimate(REQUEST, view("cpu", exact=16, runs=(("CPU", 48, CPU_BLOCK_S),)), Knowledge.EVENTS)
    assert cpu.cached_tokens == 1024 and cpu.uncached_tokens == 0
    assert cpu.load_s == pytest.approx(48 * CPU_BLOCK_S)
    assert cpu.prefill_s == pytest.approx(gpu.prefill_s + 48 * CPU_BLOCK_S)
    assert gpu.prefill_s < cpu.prefill_s < miss.prefill_s
    assert miss.prefill_s - cpu.prefill_s == pytest.approx(prefill(1024) - 48 * CPU_BLOCK_S)


def test_only_blocks_inside_the_prompt_are_loaded():
    costs = CostModel()
    short = RouteRequest(model="m", prompt_tokens=320, total_blocks=20)
    cpu = costs.estimate(short, view("cpu", exact=4, runs=(("CPU", 10, 0.01), ("STORAGE", 50, 0.1))), Knowledge.EVENTS)
    assert cpu.load_s == pytest.approx(10 * 0.01 + 6 * 0.1)


def test_router_only_knowledge_never_credits_tiers():
    costs = CostModel()
    cpu = costs.estimate(REQUEST, view("cpu", runs=(("CPU", 64, CPU_BLOCK_S),)), Knowledge.ROUTER_ONLY)
    assert cpu.cached_tokens == 0 and cpu.load_s == 0


def test_policy_prefers_a_cpu_tier_hit_and_a_miss_over_a_tier_slower_than_recompute():
    policy = make_policy("kv_aware")
    fleet = [view("miss"), view("cpu", runs=(("CPU", 64, CPU_BLOCK_S),))]
    assert policy.choose(REQUEST, fleet).chosen == "cpu"
    slow = [view("miss"), view("slow", runs=(("STORAGE", 64, 1.0),))]
    assert make_policy("kv_aware").choose(REQUEST, slow).chosen == "miss"


def test_debug_table_shows_each_matched_runs_tier():
    decision = make_policy("kv_aware").choose(REQUEST, [view("cpu", exact=2, runs=(("CPU", 3, 0.001),))])
    row = route_table(decision)["candidates"][0]
    assert row["matched_runs"] == [{"medium": "GPU", "tokens": 32}, {"medium": "CPU", "blocks": 3, "load_ms": 3.0}]
    assert row["load_ms"] == 3.0


def test_tier_config_prices_per_engine_and_can_be_turned_off():
    config = TierConfig(kv_bytes_per_token=1000, bandwidth_gbps={"CPU": 1.0})
    assert config.priced_runs([TierRun("CPU", 2)], 16) == (("CPU", 2, 16_000 / 1e9),)
    assert config.block_load_s("STORAGE", 16) == pytest.approx(16_000 / 2e9), "an unnamed tier takes its default"
    assert TierConfig(enabled=False).priced_runs([TierRun("CPU", 2)], 16) == ()
    with pytest.raises(ConfigError, match=r"engines\[0\].tiers.bandwidth_gbps.NVME"):
        EngineConfig(url="http://e", tiers=TierConfig(bandwidth_gbps={"NVME": 1.0})).validate("engines[0]")
    with pytest.raises(ConfigError, match="must be a positive number"):
        TierConfig(bandwidth_gbps={"CPU": 0.0}).validate("t")


def test_tier_settings_load_from_the_config_file(tmp_path):
    from gateway.config import load_config

    path = tmp_path / "router.toml"
    path.write_text('[[engines]]\nurl = "http://127.0.0.1:9"\n'
                    '[engines.tiers]\nkv_bytes_per_token = 4096\nbandwidth_gbps = {CPU = 8}\n')
    tiers = load_config(path, environ={}).engines[0].tiers
    assert (tiers.enabled, tiers.kv_bytes_per_token, tiers.bandwidth_gbps) == (True, 4096, {"CPU": 8.0})


def test_route_header_counts_tier_blocks_as_overlap():
    from gateway.routing import route_header

    decision = make_policy("kv_aware").choose(REQUEST, [view("cpu", runs=(("CPU", 64, CPU_BLOCK_S),))])
    assert "overlap=1024/1024" in route_header(decision) and "cache-hit-100%" in route_header(decision)
