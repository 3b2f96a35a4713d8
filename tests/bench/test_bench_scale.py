"""kvmesh bench scale: the synthetic engines' digests, the pacer, what is read from replicas, the report."""

from __future__ import annotations

import argparse
import math
import os
import time

import pytest
import trio
import zmq

from bench.cli import main
from bench.event_mix import MixEngine
from bench.replica_stats import (
    CLOCK_TICKS,
    PAGE_SIZE,
    bucket_quantile,
    cpu_pressure_seconds,
    cpu_seconds,
    engine_gauges,
    rss_bytes,
    run_wait_seconds,
    staleness,
    thread_cpu,
    thread_kind,
)
from bench.scale import add_arguments, options, queued_bytes_bound
from bench.scale_fleet import EngineEndpoints, merged_answers, replica_config
from bench.scale_report import (
    Latency,
    ReplicaResult,
    Strain,
    format_ratios,
    format_tables,
    kept_rates,
    moonshot,
    verdicts,
)
from bench.synthetic_engines import CHAIN_BLOCKS, Pacer, SyntheticEngine
from bench.synthetic_publisher import Fleet, stamped
from events.decode import BlockRemoved, BlockStored, decode_live
from gateway.config import load_config
from index.digest import block_set_digest
from index.ingest import EngineIngest
from index.prefix_index import PrefixIndex


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_publisher_digest_equals_what_an_exact_replica_reports(encoding):
    engine = SyntheticEngine(3, cap=100, model="m", encoding=encoding)
    store = PrefixIndex()
    ingest = EngineIngest("e3", "m", store)
    removed = []
    for seq in range(10):
        batch = engine.next_batch(ts=1.0)
        decoded = decode_live([b"kv", seq.to_bytes(8, "big"), batch.payload])
        ingest.apply(decoded)
        removed.append(batch.removed)
        stored = [e for e in decoded.events if isinstance(e, BlockStored)]
        evicted = [e for e in decoded.events if isinstance(e, BlockRemoved)]
        assert len(stored) == 1 and len(stored[0].block_hashes) == CHAIN_BLOCKS and stored[0].parent_block_hash is None
        assert len(stored[0].token_ids) == CHAIN_BLOCKS * 16
        assert len(evicted) == (1 if batch.removed else 0)  # one BlockRemoved per block, decoded as one run
        assert sum(len(e.block_hashes) for e in evicted) == batch.removed
    assert removed[:3] == [0, 0, 0] and removed[3] == 28 and removed[4:] == [32] * 6
    assert engine.live == store.block_count("e3") == 100
    assert engine.digest() == block_set_digest(*store.export("e3"))


def test_engines_publish_distinct_chains():
    a, b = SyntheticEngine(0, 64, "m"), SyntheticEngine(1, 64, "m")
    a.next_batch(0.0), b.next_batch(0.0)
    assert a.digest() != b.digest()


def test_pacer_spreads_ops_over_time_and_reports_slip():
    pacer = Pacer(1000.0, start=10.0)
    assert pacer.wait_s(10.0, 0) == 0.0
    assert pacer.wait_s(10.0, 64) == pytest.approx(0.064)
    assert pacer.wait_s(10.1, 64) == 0.0 and pacer.behind_s(10.1, 64) == pytest.approx(0.036)
    with pytest.raises(ValueError):
        Pacer(0.0, 0.0)


def test_cpu_and_rss_from_proc_text():
    stat = "42 (python (x) y) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 1 0 100 1000 77"
    assert cpu_seconds(stat) == pytest.approx(300 / CLOCK_TICKS)
    assert rss_bytes("1000 77 5 0 0 0 0") == 77 * PAGE_SIZE


def test_threads_are_told_apart_by_name_and_id():
    assert thread_kind(40, 41, "ZMQbg/IO/0") == thread_kind(40, 42, "ZMQbg/Reaper") == "zmq"
    assert thread_kind(40, 40, "python3") == "loop"
    assert thread_kind(40, 43, "Trio thread 2") == "others"


def test_a_process_cpu_is_split_by_its_threads():
    """This process's main thread burns CPU beside a ZeroMQ context's I/O thread: the split charges it to the
    loop, and no kind's seconds go backwards."""
    context = zmq.Context()
    try:
        context.socket(zmq.PUB).close()  # a socket starts the context's I/O thread
        before = thread_cpu(os.getpid())
        started = time.thread_time()
        while time.thread_time() - started < 0.05:
            pass
        after = thread_cpu(os.getpid())
    finally:
        context.term()
    assert after["loop"] - before["loop"] >= 0.05 - 2 / CLOCK_TICKS
    assert all(after[kind] >= before[kind] for kind in after)


METRICS = """# HELP kvmesh_event_batches_total KV-event batches applied to the index
# TYPE kvmesh_event_batches_total counter
kvmesh_event_batches_total{engine="e0"} 12.0
kvmesh_event_batches_total{engine="e1"} 3.0
# HELP kvmesh_engine_healthy 1 when the engine takes traffic
# TYPE kvmesh_engine_healthy gauge
kvmesh_engine_healthy{engine="e0"} 1.0
kvmesh_engine_healthy{engine="e1"} 0.0
# HELP kvmesh_index_blocks Blocks the index says each engine holds
# TYPE kvmesh_index_blocks gauge
kvmesh_index_blocks{engine="e0"} 384.0
# HELP kvmesh_event_replays_total Replay requests by outcome
# TYPE kvmesh_event_replays_total counter
kvmesh_event_replays_total{engine="e0",outcome="requested"} 2.0
kvmesh_event_replays_total{engine="e1",outcome="requested"} 1.0
kvmesh_event_replays_total{engine="e1",outcome="completed"} 1.0
# HELP kvmesh_events_dropped_total KV-event messages dropped before reaching the index
# TYPE kvmesh_events_dropped_total counter
kvmesh_events_dropped_total{engine="e1",reason="duplicate"} 4.0
# HELP kvmesh_event_ingest_deferred_seconds_total Seconds event ingest waited
# TYPE kvmesh_event_ingest_deferred_seconds_total counter
kvmesh_event_ingest_deferred_seconds_total{engine="e0"} 0.25
kvmesh_event_ingest_deferred_seconds_total{engine="e1"} 0.5
# HELP kvmesh_event_block_ops_total Block operations applied from KV events
# TYPE kvmesh_event_block_ops_total counter
kvmesh_event_block_ops_total{engine="e0",op="stored"} 384.0
kvmesh_event_block_ops_total{engine="e0",op="removed"} 64.0
kvmesh_event_block_ops_total{engine="e0",op="orphaned"} 1.0
# HELP kvmesh_event_loop_lag_seconds How late the router's event loop woke a task
# TYPE kvmesh_event_loop_lag_seconds histogram
kvmesh_event_loop_lag_seconds_bucket{le="0.001"} 90.0
kvmesh_event_loop_lag_seconds_bucket{le="0.01"} 99.0
kvmesh_event_loop_lag_seconds_bucket{le="+Inf"} 100.0
kvmesh_event_loop_lag_seconds_count 100.0
# HELP kvmesh_ingest_seconds_total Seconds KV-event ingest took on this process, by step
# TYPE kvmesh_ingest_seconds_total counter
kvmesh_ingest_seconds_total{step="decode"} 0.5
kvmesh_ingest_seconds_total{step="keys"} 0.25
# HELP kvmesh_requests_total Requests answered
# TYPE kvmesh_requests_total counter
kvmesh_requests_total{endpoint="chat",status="200"} 5.0
"""


def test_engine_gauges_follow_only_the_per_engine_samples():
    gauges = engine_gauges(METRICS)
    assert gauges.batches == {"e0": 12, "e1": 3} and gauges.blocks == {"e0": 384} and gauges.unhealthy == 1
    assert (gauges.replays, gauges.dropped, gauges.deferred_s, gauges.block_ops) == (3, 4, 0.75, 448)
    assert gauges.loop_lag == {0.001: 90.0, 0.01: 99.0, math.inf: 100.0}
    assert gauges.ingest_s == {"decode": 0.5, "keys": 0.25}


def test_loop_lag_quantile_counts_only_what_was_observed_between_two_scrapes():
    before = {0.001: 90.0, 0.01: 99.0, math.inf: 100.0}
    after = {0.001: 150.0, 0.01: 199.0, math.inf: 200.0}  # 60 within 1 ms, 40 more within 10 ms
    assert bucket_quantile(before, after, 0.99) == 0.01
    assert bucket_quantile(before, after, 0.50) == 0.001
    assert bucket_quantile(before, {0.001: 90.0, 0.01: 99.0, math.inf: 110.0}, 0.99) == math.inf
    assert math.isnan(bucket_quantile(before, before, 0.99))


def test_run_queue_wait_and_cpu_pressure_from_proc_text():
    assert run_wait_seconds(["1000 2500000000 7\n", "5 500000000 1\n", ""]) == pytest.approx(3.0)
    psi = "some avg10=1.00 avg60=2.00 avg300=3.00 total=4500000\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    assert cpu_pressure_seconds(psi) == pytest.approx(4.5)


def test_staleness_is_the_age_of_the_oldest_unapplied_batch():
    published = {"e0": [1.0, 2.0, 3.0], "e1": [1.5]}
    assert staleness(2.5, {"e0": 1, "e1": 1}, published) == [0.5, 0.0]
    assert staleness(2.5, {"e0": 2}, published) == [0.0, 1.0]  # seq 2 not sent yet; e1 nothing applied
    assert staleness(9.0, {"e0": 3, "e1": 1}, published) == [0.0, 0.0]


def test_replica_config_is_a_valid_router_config(tmp_path):
    engines = [EngineEndpoints(f"e{i}", f"http://127.0.0.1:{8100 + i}", f"tcp://127.0.0.1:{5000 + i}",
                               f"tcp://127.0.0.1:{6000 + i}") for i in range(2)]
    path = tmp_path / "router.toml"
    path.write_text(replica_config(9000, engines, "kvmesh-tiny", [7001, 7002], 1, tmp_path / "s", "redis://h:1/0",
                                   "scale"))
    config = load_config(path, environ={})
    assert [(e.id, e.events, e.replay, e.model) for e in config.engines] == [
        ("e0", "tcp://127.0.0.1:5000", "tcp://127.0.0.1:6000", "kvmesh-tiny"),
        ("e1", "tcp://127.0.0.1:5001", "tcp://127.0.0.1:6001", "kvmesh-tiny"),
    ]
    assert config.mesh.bind == "127.0.0.1:7002" and config.mesh.seeds == ["127.0.0.1:7001"]
    assert config.mesh.redis_url == "redis://h:1/0" and config.port == 9000


def _result(replicas, replica, cpu, rss_end=2_000_000, converge=1.0, unhealthy=0, burst_p99=40.0, ready_p99=10.0,
            burst_lag=20.0, rate=10_000.0, lag=3.0, burst_applied=19_000.0):
    result = ReplicaResult(
        replicas, 10_000.0, replica, 9_990.0, 19_000.0, 9_990.0, cpu, 0.02, 1_000_000, rss_end, 10_000, 9_000_000,
        0.5, 3.0, burst_lag, True, converge, unhealthy, 1, 0, 0.5, Latency(10.0, 30.0, 300),
        Latency(12.0, burst_p99, 280), Latency(1.0, 2.0, 200), Latency(1.5, ready_p99, 190), Strain(2.5, 0.05, 0.1),
        Strain(10.0, 0.25, 0.6), {"decode": 2.0, "keys": 0.5, "store": 3.0, "rest": 0.5}, burst_applied,
        {"zmq": 0.3, "loop": 9.5, "others": 0.2},
    )  # fmt: skip
    scale = rate / result.rate  # the same shares of what was published at another rate
    result.rate, result.published_ops_per_s, result.burst_ops_per_s = rate, 9_990.0 * scale, 19_000.0 * scale
    result.applied_ops_per_s, result.burst_applied_ops_per_s = 9_990.0 * scale, burst_applied * scale
    result.lag_p99_ms = lag
    return result


def test_verdicts_pass_when_flat_in_replicas_and_serving_holds():
    results = [_result(1, 0, 4.0), _result(2, 0, 4.4), _result(2, 1, 4.8), _result(3, 0, 6.0)]
    lines = [v.line() for v in verdicts(results)]
    assert all(line.startswith("PASS") for line in lines), lines
    assert any("R=2 vs R=1" in line and "1.200" in line for line in lines)
    assert any("RSS per live block at R=3, 10000 ops/s" in line and "10,000 live blocks" in line for line in lines)
    # idle 2% of a core at 9,990 ops/s is 2.002 us of each op: 6.0 us gross is 3.998 net
    assert any(line.startswith("PASS  net CPU per block op at R=3, 10000 ops/s") and "250,125 block ops/s" in line
               for line in lines), lines
    assert "rate 10000 R=2: cpu/op 1.15x  RSS/block 1.00x" in format_ratios(results)
    assert moonshot(results).startswith("moonshot (not judged): 250125 block ops/s per replica core at R=3")
    assert "(goal 1,000,000)" in moonshot(results)


def test_verdicts_fail_on_cost_growth_memory_slow_serving_and_no_convergence():
    results = [_result(1, 0, 10.0), _result(3, 0, 16.0, rss_end=5_000_000, converge=math.inf, unhealthy=2,
                                            burst_p99=90.0, ready_p99=150.0, burst_lag=250.0)]
    judged = verdicts(results)
    assert any("its loop lag p99 10 ms, it waited for a core 25% of the time, machine CPU pressure 60%" in v.line()
               for v in judged if v.target.startswith("/ready"))
    failed = {v.target.split(" (")[0].split(",")[0] for v in judged if not v.passed}
    assert failed == {"CPU per block op", "RSS per live block at R=3", "chat p99 during the 2x burst / idle p99",
                      "/ready p99 during the 2x burst", "engines marked unhealthy by a replica",
                      "convergence on the publisher's live set after the burst", "net CPU per block op at R=3",
                      "replication lag p99 during the 2x burst"}


def test_an_overload_burst_is_judged_on_its_memory_bound_and_a_longer_convergence():
    """At 150k the burst is 300k, over what a replica must keep while serving: its lag is not judged, its RSS
    growth is held to its event queues' bound and its convergence to 10 s instead of 5."""
    def overloaded(converge, growth):
        result = _result(1, 0, 5.0, rate=150_000.0, burst_lag=4_000.0, converge=converge)
        result.burst_rss_growth, result.queue_bound_bytes = growth, 300e6
        return result

    judged = {v.target: v for v in verdicts([overloaded(7.0, 100e6)])}
    assert not any(target.startswith("replication lag") for target in judged)
    assert judged["RSS growth in an overload burst (over 150,000 ops/s) / its event queues' bound (x)"].passed
    assert judged["convergence on the publisher's live set after an overload burst (s)"].passed
    judged = {v.target: v for v in verdicts([overloaded(11.0, 400e6)])}
    assert not judged["RSS growth in an overload burst (over 150,000 ops/s) / its event queues' bound (x)"].passed
    assert "400 MB against 300 MB" in judged[
        "RSS growth in an overload burst (over 150,000 ops/s) / its event queues' bound (x)"].line()
    assert not judged["convergence on the publisher's live set after an overload burst (s)"].passed
    sustained = {v.target for v in verdicts([_result(1, 0, 5.0, rate=75_000.0, converge=7.0)]) if not v.passed}
    assert "convergence on the publisher's live set after the burst, up to 150,000 ops/s (s)" in sustained


def test_tables_show_every_replica():
    text = format_tables([_result(1, 0, 10.0), _result(2, 1, 11.0, converge=math.inf)])
    rows = [line for line in text.splitlines() if line.strip().startswith(("1 ", "2 "))]
    assert len(rows) == 8 and "100.0" in rows[0] and " inf " in rows[5] and "12.0/40.0" in rows[6]
    assert "    9.0   yes " in rows[4]
    assert " 19000      9990     10.00      8.00 " in rows[0]  # idle 2% of a core at ~10k ops/s is 2 us of each op
    # the split: decode, keys, store and rest sum to the ingest's 6 us; the other 4 (of 10) are outside it
    assert rows[2].split()[3:] == ["2.00", "0.50", "3.00", "0.50", "6.00", "4.00", "0.30", "0.20", "10.00"]
    assert rows[6].split()[-2:] == ["2/5/10", "10/25/60"]


def test_a_replica_without_ingest_times_shows_no_split():
    result = _result(1, 0, 10.0)
    result.ingest_us = {}
    assert math.isnan(result.ingest_us_per_op) and math.isnan(result.outside_us_per_op)
    split = [line for line in format_tables([result]).splitlines() if line.strip().startswith("1 ")][1]
    assert split.split()[3:] == ["-"] * 6 + ["0.30", "0.20", "10.00"]


def test_kept_rates_name_the_highest_rate_each_window_kept_pace_with():
    results = [_result(1, 0, 5.0, rate=10_000.0), _result(1, 0, 5.0, rate=50_000.0, burst_lag=900.0),
               _result(2, 0, 5.0, rate=10_000.0, burst_p99=90.0), _result(2, 1, 5.0, rate=10_000.0)]
    lines = kept_rates(results)
    # R=1: both steady windows kept; of the bursts (2x) only 10k's: 50k's fell 900 ms behind
    assert lines[0].startswith("highest rate kept at R=1: steady (scrapes only) 49,950; while serving chat 19,000 "
                               "block ops/s; not kept while serving: 95,000 (applied 100%, lag p99 900 ms"), lines
    # R=2: one replica's chat p99 went from 30 to 90 ms in the burst, 3x idle: not kept while serving
    assert lines[1].startswith("highest rate kept at R=2: steady (scrapes only) 9,990; while serving chat none of "
                               "the rates measured; not kept while serving: 19,000 (applied 100%, lag p99 20 ms, "
                               "chat p99 3.00x idle)"), lines
    behind = _result(1, 0, 5.0, lag=250.0, burst_applied=15_000.0)  # fell behind in both windows
    assert kept_rates([behind]) == ["highest rate kept at R=1: steady (scrapes only) none; while serving chat none "
                                    "of the rates measured; not kept while serving: 19,000 (applied 79%, lag p99 "
                                    "20 ms, chat p99 1.33x idle)"]


@pytest.mark.integration
def test_smallest_scale_run_converges_on_the_publishers_live_set(tmp_path, capsys):
    """Two publisher processes play the two engines: the replica must equal their merged live sets."""
    code = main(["scale", "--replicas", "1", "--rates", "2000", "--engines", "2", "--cap", "128", "--steady-s", "1",
                 "--burst-s", "1", "--probe-s", "0.5", "--converge-timeout-s", "10", "--publishers", "2",
                 "--log-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code in (0, 1), out
    ingest, split, after_burst, serving = [line for line in out.splitlines()
                                           if line.split()[:3] == ["1", "2000", "0"]]
    assert " yes " in after_burst and "/" in serving, out
    decode, keys, store, rest, total = (float(x) for x in split.split()[3:8])
    assert decode > 0 and keys > 0 and store > 0 and rest >= 0, out  # the replica reported its ingest's steps
    assert total == pytest.approx(decode + keys + store + rest, abs=0.02)
    assert any(line.startswith("highest rate kept at R=1: steady (scrapes only) ") for line in out.splitlines()), out
    assert any(line.startswith("PASS  convergence") for line in out.splitlines()), out
    assert (tmp_path / "scale.png").exists()


def test_quick_sets_defaults_that_explicit_flags_override():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    quick = options(parser.parse_args(["--quick", "--replicas", "1"]))
    assert quick.replicas == [1] and quick.rates == [10000.0] and quick.engines == 8 and quick.steady_s == 6.0
    full = options(parser.parse_args(["--encoding", "array"]))
    assert full.replicas == [1, 2, 3] and full.rates == [10000.0, 50000.0] and full.encoding == "array"


def test_publishers_answers_merge_in_engine_order():
    first = {"ops": 10, "stored": 6, "removed": 4, "full": True, "seconds": 2.0, "ops_per_s": 5.0, "behind_s": 0.1,
             "first_seq": [0, 3], "times": [[1.0], [1.5]], "bytes": 900}
    second = {"ops": 30, "stored": 20, "removed": 10, "full": False, "seconds": 2.5, "ops_per_s": 12.0,
              "behind_s": 0.4, "first_seq": [7], "times": [[2.0, 2.1]], "bytes": 2100}
    merged = merged_answers([first, second])
    assert merged["ops"] == 40 and merged["stored"] == 26 and merged["removed"] == 14 and not merged["full"]
    assert merged["seconds"] == 2.5 and merged["ops_per_s"] == 16.0 and merged["behind_s"] == 0.4
    assert merged["first_seq"] == [0, 3, 7] and merged["times"] == [[1.0], [1.5], [2.0, 2.1]]
    # 3,000 bytes in 4 messages: 750 B each, in two queues of 1,000 messages per engine, three engines
    assert queued_bytes_bound(3, merged) == 3 * 2 * 1_000 * 750
    state = merged_answers([{"engines": [{"blocks": 1}]}, {"engines": [{"blocks": 2}, {"blocks": 3}]}])
    assert [e["blocks"] for e in state["engines"]] == [1, 2, 3]


class _Recorder:
    """Stands where a fleet's EventPublisher goes: keeps what is published, in order."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []
        self.seq = 0

    def publish(self, payload: bytes) -> None:
        self.payloads.append(payload)
        self.seq += 1


def test_a_prepared_run_sends_every_prepared_batch_restamped_and_leaves_the_live_sets_as_sent():
    def fleet() -> Fleet:
        return Fleet([MixEngine(i, 300, "m", seed=5) for i in range(2)], [_Recorder(), _Recorder()])

    prepared, twin = fleet(), fleet()
    answer = prepared.prepare(3000, 1.0)
    assert answer["prepared_ops"] >= 3000 and all(not r.payloads for r in prepared.publishers)
    before = time.time()
    sent = trio.run(prepared.publish, 1e9, 0.0)  # no time at all: it still sends everything prepared
    assert sent["ops"] == answer["prepared_ops"] and sum(map(len, sent["times"])) == answer["batches"]
    assert sent["bytes"] == sum(len(payload) for recorder in prepared.publishers for payload in recorder.payloads)
    expected: list[list[bytes]] = [[], []]
    for _ in range(answer["batches"]):
        i, batch = twin._generate()
        expected[i].append(batch.payload)
    for recorder, payloads in zip(prepared.publishers, expected, strict=True):
        assert len(recorder.payloads) == len(payloads)
        for seq, (got, generated) in enumerate(zip(recorder.payloads, payloads, strict=True)):
            frames = [b"kv", seq.to_bytes(8, "big")]
            assert decode_live([*frames, got]).events == decode_live([*frames, generated]).events
            assert decode_live([*frames, got]).ts >= before  # stamped when sent, not when generated
    assert [e.digest() for e in prepared.engines] == [e.digest() for e in twin.engines]
    assert decode_live([b"kv", bytes(8), stamped(expected[0][0], 123.5)]).ts == 123.5
