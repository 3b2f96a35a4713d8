"""Numbers an engine reports in /metrics are bounded: impossible load gauges refuse the poll, impossible
cache geometry or counters are left out; each is counted per engine and value."""

from __future__ import annotations

from functools import partial

import pytest
import trio
from prometheus_client import REGISTRY

from events.metrics_poller import MetricsOutOfRange, parse_vllm_metrics, poll_metrics

RUNNING = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2\n"


def page(running: str = "2", waiting: str = "1", usage: str = "0.5", blocks: str = "1024", size: str = "16",
         queries: str = "10", hits: str = "5") -> str:
    return (f"vllm:num_requests_running {running}\nvllm:num_requests_waiting {waiting}\n"
            f"vllm:kv_cache_usage_perc {usage}\n"
            f"# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total {queries}\n"
            f"# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total {hits}\n"
            f'vllm:cache_config_info{{block_size="{size}",num_gpu_blocks="{blocks}"}} 1\n')


def test_sane_numbers_pass_unchanged():
    load = parse_vllm_metrics(page())
    assert (load.running, load.waiting, load.kv_cache_usage, load.num_gpu_blocks, load.block_size) == (2, 1, 0.5,
                                                                                                       1024, 16)
    assert load.rejected == ()


@pytest.mark.parametrize(("changes", "rejected", "field", "value"), [
    ({"blocks": "1e308"}, "num_gpu_blocks", "num_gpu_blocks", None),
    ({"blocks": str(2**31 + 1)}, "num_gpu_blocks", "num_gpu_blocks", None),
    ({"blocks": "inf"}, "num_gpu_blocks", "num_gpu_blocks", None),
    ({"blocks": "12.5"}, "num_gpu_blocks", "num_gpu_blocks", None),
    ({"size": "8192"}, "block_size", "block_size", None),
    ({"size": "-16"}, "block_size", "block_size", None),
    ({"queries": "1e300"}, "prefix_cache_queries", "prefix_cache_queries", 0.0),
    ({"hits": "-5"}, "prefix_cache_hits", "prefix_cache_hits", 0.0),
])
def test_impossible_geometry_and_counters_are_left_out_and_named(changes, rejected, field, value):
    load = parse_vllm_metrics(page(**changes))
    assert load.rejected == (rejected,)
    assert getattr(load, field) == value
    assert load.running == 2


def test_kv_usage_is_clamped_and_an_unknown_block_count_is_not_a_rejection():
    assert parse_vllm_metrics(page(usage="7")).kv_cache_usage == 1.0
    assert parse_vllm_metrics(page(usage="-1")).kv_cache_usage == 0.0
    load = parse_vllm_metrics(page(blocks="None"))
    assert load.num_gpu_blocks is None and load.rejected == ()


@pytest.mark.parametrize("changes", [{"running": "1e7"}, {"waiting": "-3"}, {"running": "1e308"}])
def test_impossible_load_gauges_refuse_the_whole_poll(changes):
    with pytest.raises(MetricsOutOfRange):
        parse_vllm_metrics(page(**changes))


async def test_the_poller_counts_rejections_per_engine_and_value():
    engine, loads = "poller-liar", []  # a name no other test uses: the registry is process-wide
    bodies = iter([page(blocks="1e308").encode(), page(running="1e9").encode()])

    async def fetch(_url: str) -> bytes:
        return next(bodies, page().encode())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(poll_metrics, engine, "/metrics", fetch, lambda load, now: loads.append(load),
                                   interval_s=0.001))
        with trio.fail_after(5):
            while len(loads) < 2:
                await trio.sleep(0.001)
        nursery.cancel_scope.cancel()
    assert loads[0].num_gpu_blocks is None and loads[1].num_gpu_blocks == 1024
    value = partial(REGISTRY.get_sample_value, "kvmesh_engine_values_rejected_total")
    assert value({"engine": engine, "value": "num_gpu_blocks"}) == 1
    assert value({"engine": engine, "value": "running"}) == 1
    assert REGISTRY.get_sample_value("kvmesh_metrics_polls_total", {"engine": engine, "outcome": "out_of_range"}) == 1
