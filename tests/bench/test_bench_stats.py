"""Percentiles, summaries, SSE parsing and metric deltas: the arithmetic the tables rest on."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench import engine_stats
from bench.sse import SseSplitter, StreamedAnswer, usage_counts
from bench.stats import RequestResult, late_hit_rate, percentile, ratio, shares, summarize


def test_percentile_interpolates():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0], 100) == 3.0
    assert math.isnan(percentile([], 50))


@given(st.lists(st.floats(-1e6, 1e6), min_size=1), st.floats(0, 100), st.floats(0, 100))
def test_percentile_is_monotone_and_bounded(values, q1, q2):
    lo, hi = sorted((q1, q2))
    assert min(values) <= percentile(values, lo) <= percentile(values, hi) <= max(values)


def test_summary_counts_errors_and_spreads_routes():
    results = [
        RequestResult(status=200, ttft=0.1, total=0.2, output_tokens=4, route="e0"),
        RequestResult(status=200, ttft=0.3, total=0.4, output_tokens=4, route="e1"),
        RequestResult(status=200, ttft=0.2, total=0.3, output_tokens=4, route="e0"),
        RequestResult(status=503),
        RequestResult(error="timeout"),
    ]
    s = summarize(results, wall=2.0)
    assert (s.requests, s.errors) == (5, 2)
    assert s.ttft_p50 == 0.2
    assert s.req_per_s == 1.5
    assert s.out_tok_per_s == 6.0
    assert s.routes == {"e0": 2, "e1": 1}
    assert s.error_kinds == {"http 503": 1, "timeout": 1}


def test_shares_and_ratio():
    assert shares({"a": 3, "b": 1}, ["a", "b", "c"]) == [0.75, 0.25, 0.0]
    assert shares({}, ["a"]) == [0.0]
    assert ratio(1.0, 4.0) == 0.25
    assert math.isnan(ratio(1.0, 0.0))


def _chunk(text: str) -> str:
    return json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]})


@given(st.lists(st.integers(1, 40), max_size=30))
def test_sse_splitter_is_independent_of_chunking(cuts):
    events = [_chunk("a"), _chunk("b c"), json.dumps({"usage": {"completion_tokens": 7}}), "[DONE]"]
    raw = "".join(f"data: {e}\r\n\r\n" if i % 2 else f"data:{e}\n\n" for i, e in enumerate(events)).encode()
    splitter = SseSplitter()
    got, pos = [], 0
    for cut in cuts:
        got += splitter.feed(raw[pos : pos + cut])
        pos += cut
    got += splitter.feed(raw[pos:])
    assert got == events


def test_streamed_answer_marks_first_content_and_prefers_usage():
    answer = StreamedAnswer()
    role_only = json.dumps({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert answer.apply(role_only) is False
    assert answer.apply(_chunk("hi")) is True
    assert answer.apply(_chunk(" there")) is False
    assert answer.output_tokens == 2
    assert answer.apply(json.dumps({"choices": [], "usage": {"completion_tokens": 5}})) is False
    assert answer.apply("[DONE]") is False
    assert (answer.text, answer.output_tokens, answer.done) == ("hi there", 5, True)


def test_streamed_answer_counts_garbage_and_reads_completions_text():
    answer = StreamedAnswer()
    for junk in ("{not json", "[1, 2]", json.dumps({"choices": "x"}), json.dumps({"choices": [7]})):
        assert answer.apply(junk) is False
    assert answer.malformed == 2
    assert answer.apply(json.dumps({"choices": [{"text": "ok"}]})) is True
    answer.apply(json.dumps({"error": {"message": "boom"}}))
    assert answer.error


def test_streamed_answer_reads_the_engines_cached_tokens():
    answer = StreamedAnswer()
    usage = {"completion_tokens": 3, "prompt_tokens": 2104, "prompt_tokens_details": {"cached_tokens": 2048}}
    answer.apply(json.dumps({"choices": [], "usage": usage}))
    assert (answer.output_tokens, answer.prompt_tokens, answer.cached_tokens) == (3, 2104, 2048)


@given(
    st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=3), st.booleans(), st.just([1])),
    st.one_of(st.none(), st.just("x"), st.just([]), st.dictionaries(st.just("cached_tokens"), st.integers(-3, 3))),
)
def test_usage_counts_never_trusts_malformed_fields(prompt, details):
    completion, prompt_tokens, cached = usage_counts({"prompt_tokens": prompt, "prompt_tokens_details": details})
    assert completion is None
    assert prompt_tokens == (prompt if isinstance(prompt, int) and not isinstance(prompt, bool) and prompt >= 0
                             else None)
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    assert cached == (value if isinstance(value, int) and value >= 0 else None)


def test_request_hit_needs_the_whole_shared_prefix_in_blocks():
    def result(**kw):
        return RequestResult(status=200, ttft=0.1, total=0.1, **kw)

    results = [
        result(reusable_tokens=2048, cached_tokens=2048),
        result(reusable_tokens=2048, cached_tokens=2064),
        result(reusable_tokens=2048, cached_tokens=2032),
        result(reusable_tokens=0, cached_tokens=0),
        result(reusable_tokens=2048),
        RequestResult(status=503, reusable_tokens=2048, cached_tokens=2048),
    ]
    assert [r.prefix_hit for r in results] == [True, True, False, None, None, None]
    s = summarize(results, wall=1.0)
    assert (s.prefix_hits, s.prefix_judged) == (2, 3)
    assert s.request_hit_rate == 2 / 3
    assert math.isnan(summarize(results[3:5], wall=1.0).request_hit_rate)


METRICS = """# HELP vllm:prefix_cache_queries Prefix cache queries
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
# HELP vllm:prefix_cache_hits Prefix cache hits
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 400.0
# HELP vllm:request_success Finished requests
# TYPE vllm:request_success counter
vllm:request_success_total{finished_reason="stop",model_name="m"} 3.0
vllm:request_success_total{finished_reason="length",model_name="m"} 7.0
# HELP vllm:num_requests_running Running
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 2.0
"""


def test_parse_counters_sums_label_sets():
    snap = engine_stats.parse_counters(METRICS)
    assert snap[engine_stats.QUERIES] == 1000.0
    assert snap[engine_stats.HITS] == 400.0
    assert snap[engine_stats.SUCCESSES] == 10.0
    assert snap[engine_stats.PROMPT_TOKENS] == 0.0


def test_hit_rate_delta_and_restart():
    before = {engine_stats.HITS: 400.0, engine_stats.QUERIES: 1000.0}
    after = {engine_stats.HITS: 1300.0, engine_stats.QUERIES: 2000.0}
    d = engine_stats.delta(before, after)
    assert engine_stats.hit_rate(d) == 0.9
    restarted = engine_stats.delta(before, {engine_stats.HITS: 50.0, engine_stats.QUERIES: 100.0})
    assert engine_stats.hit_rate(restarted) == 0.5
    assert math.isnan(engine_stats.hit_rate({}))


def test_fleet_hit_rate_weights_by_tokens():
    big = {engine_stats.HITS: 900.0, engine_stats.QUERIES: 1000.0}
    small = {engine_stats.HITS: 0.0, engine_stats.QUERIES: 100.0}
    assert engine_stats.fleet_hit_rate([big, small, {}]) == 900.0 / 1100.0


def test_a_routers_mean_decision_time_comes_from_its_histogram_over_replicas():
    text = ("# TYPE kvmesh_route_decision_seconds histogram\n"
            'kvmesh_route_decision_seconds_bucket{le="+Inf"} 4.0\n'
            "kvmesh_route_decision_seconds_sum 0.02\nkvmesh_route_decision_seconds_count 4.0\n")
    before = engine_stats.parse_counters(text, engine_stats.ROUTER_COUNTERS)
    after = engine_stats.parse_counters(text.replace("0.02", "0.05").replace("4.0", "10.0"),
                                        engine_stats.ROUTER_COUNTERS)
    replica = engine_stats.delta(before, after)
    assert math.isclose(engine_stats.mean_decision_ms([replica, replica]), 5.0)
    assert math.isnan(engine_stats.mean_decision_ms([{}]))


def test_late_hit_rate_counts_the_requests_sent_after_the_first_ones_by_start():
    results = [
        RequestResult(started=2.0, status=200, prompt_tokens=100, cached_tokens=100),
        RequestResult(started=0.0, status=200, prompt_tokens=100, cached_tokens=0),
        RequestResult(started=3.0, status=200, prompt_tokens=300, cached_tokens=0),
        RequestResult(started=1.0, status=200, prompt_tokens=100, cached_tokens=0),
        RequestResult(started=4.0, status=502, error="x", prompt_tokens=100, cached_tokens=100),
        RequestResult(started=5.0, status=200),
    ]
    assert late_hit_rate(results, 2) == pytest.approx(100 / 400)
    assert late_hit_rate(results, 0) == pytest.approx(100 / 600)
    assert math.isnan(late_hit_rate(results, 5))
