"""Discovery parsing, vLLM /metrics parsing, and the poller against a loopback server."""

from __future__ import annotations

import json
from functools import partial

import pytest
import trio
from prometheus_client import REGISTRY

from events.discovery import parse_kv_event_sources
from events.metrics_poller import MetricsParseError, parse_vllm_metrics, poll_metrics
from gateway.upstream import EnginePool

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 640.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 320.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",num_gpu_blocks="1024",prefix_caching_hash_algo="sha256"} 1.0
"""


def test_parse_vllm_metrics_sums_engines_and_reads_cache_config():
    load = parse_vllm_metrics(METRICS)
    assert (load.running, load.waiting, load.kv_cache_usage) == (3, 4, 0.25)
    assert (load.block_size, load.num_gpu_blocks) == (32, 1024)
    assert (load.prefix_cache_queries, load.prefix_cache_hits) == (640.0, 320.0)


def test_families_not_read_change_nothing():
    buckets = "".join(f'vllm:time_to_first_token_seconds_bucket{{le="{b}",model_name="tiny"}} {b}\n' for b in range(40))
    noise = ("# HELP vllm:time_to_first_token_seconds mentions vllm:num_requests_running in its help\n"
             "# TYPE vllm:time_to_first_token_seconds histogram\n" + buckets
             + "# TYPE process_cpu_seconds counter\nprocess_cpu_seconds_total 12.5\n")
    page = noise + METRICS + noise.replace("time_to_first_token", "e2e_request_latency")
    assert parse_vllm_metrics(page) == parse_vllm_metrics(METRICS)


@pytest.mark.parametrize("text", ["", "garbage {{{", "other_metric 1\n", "vllm:num_requests_running{a=\"1\" 2\n"])
def test_parse_rejects_non_vllm_text(text):
    with pytest.raises(MetricsParseError):
        parse_vllm_metrics(text)


def test_discovery_resolves_wildcards_and_data_parallel_ranks():
    body = json.dumps({
        "1": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
              "replay_endpoint": "tcp://*:5558", "topic": "kv"},
        "0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
              "replay_endpoint": None, "topic": "kv", "buffer_steps": 10},
        "2": {"enable_kv_cache_events": False, "endpoint": "tcp://*:5557"},
        "3": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://10.1.2.3:6000"},
    })
    sources = parse_kv_event_sources(body, "http://engine-a:8000")
    assert [(s.rank, s.endpoint, s.replay_endpoint) for s in sources] == [
        (0, "tcp://engine-a:5557", None),
        (1, "tcp://engine-a:5558", "tcp://engine-a:5559"),
        (3, "tcp://10.1.2.3:6003", None),  # connect mode: connected to, never bound for the engine
    ]
    assert parse_kv_event_sources({"0": {"enable_kv_cache_events": True, "endpoint": "tcp://[::]:7"}},
                                  "http://[::1]:80")[0].endpoint == "tcp://[::1]:7"
    with pytest.raises(ValueError):
        parse_kv_event_sources(b"[1, 2]", "http://x")


async def serve(responses: list[bytes], task_status=trio.TASK_STATUS_IGNORED):
    """A loopback HTTP server answering each connection with the next canned response."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    index = 0

    async def handle(stream):
        nonlocal index
        async with stream:
            await stream.receive_some(65536)
            await stream.send_all(responses[min(index, len(responses) - 1)])
            index += 1

    await trio.serve_listeners(handle, listeners)


def response(status: int, body: bytes) -> bytes:
    return b"HTTP/1.1 %d X\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (status, len(body), body)


async def test_poller_reports_loads_and_counts_failures():
    loads = []
    engine = "poll-engine"
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve, [response(200, METRICS.encode()), response(200, b"nope"),
                                           response(200, METRICS.encode())])
        pool = EnginePool(f"http://127.0.0.1:{port}")

        async def fetch(path: str) -> bytes:
            return (await pool.get(path))[1]

        nursery.start_soon(partial(poll_metrics, engine, "/metrics", fetch, lambda load, now: loads.append(load),
                                   interval_s=0.01))
        with trio.fail_after(10):
            while len(loads) < 2:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert loads[0].running == 3
    assert REGISTRY.get_sample_value("kvmesh_metrics_polls_total", {"engine": engine, "outcome": "malformed"}) == 1
