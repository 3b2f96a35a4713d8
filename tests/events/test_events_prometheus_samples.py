"""Reading chosen samples of a /metrics page: what prometheus_client's own parser reads, for the wanted names
only; anything else on a wanted line is a SampleError, never another exception."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from events.prometheus_samples import SampleError, wanted_samples

NAMES = frozenset({"vllm:num_requests_running", "vllm:prefix_cache_hits_total", "vllm:cache_config_info"})
label_values = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
values = st.one_of(st.floats(allow_nan=False), st.integers(-2**60, 2**60).map(float))


def _reference(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name in NAMES]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(label_values, label_values, values), max_size=4), values, values)
def test_what_prometheus_client_writes_is_read_as_its_parser_reads_it(series, hits, running):
    registry = CollectorRegistry()
    info = Gauge("vllm:cache_config_info", "geometry", ["block_size", "num_gpu_blocks"], registry=registry)
    for size, blocks, value in series:
        info.labels(size, blocks).set(value)
    Gauge("vllm:num_requests_running", "running", registry=registry).set(running)
    Gauge("vllm:num_requests_waiting", "waiting", registry=registry).set(1)
    Counter("vllm:prefix_cache_hits", "hits", registry=registry).inc(abs(hits) if math.isfinite(hits) else 1)
    text = generate_latest(registry).decode()
    assert [(s.name, s.labels, s.value) for s in wanted_samples(text, NAMES)] == _reference(text)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([*NAMES, "vllm:num_requests_waiting", "vllm:prefix_cache_hits_created"]),
                          st.text(st.sampled_from('{}=",\\ \t0123456789abn.eE+-Inf_'), max_size=30)),
                max_size=6))
def test_any_wanted_line_parses_or_raises_a_sample_error(lines):
    text = "\n".join(name + rest for name, rest in lines)
    try:
        found = list(wanted_samples(text, NAMES))
    except SampleError:
        return
    assert all(sample.name in NAMES for sample in found)


@pytest.mark.parametrize("line", ['vllm:num_requests_running{a="1" 2', "vllm:num_requests_running",
                                  "vllm:num_requests_running two", 'vllm:cache_config_info{block_size=16} 1',
                                  'vllm:cache_config_info{block_size="16"} 1 2 3'])
def test_a_broken_wanted_line_is_refused(line):
    with pytest.raises(SampleError):
        list(wanted_samples(line + "\n", NAMES))


def test_escapes_timestamps_and_other_families():
    text = ('# HELP vllm:num_requests_running mentions vllm:cache_config_info{broken\n'
            'vllm:cache_config_info{block_size="1\\"6",num_gpu_blocks="a\\\\b\\nc",} 1 1700000000000\n'
            "vllm:num_requests_running_other{ 3\n"
            "vllm:prefix_cache_hits_created 1.7e9\n"
            "vllm:num_requests_running +Inf\n")
    found = [(s.name, s.labels, s.value) for s in wanted_samples(text, NAMES)]
    assert found == [("vllm:cache_config_info", {"block_size": '1"6', "num_gpu_blocks": "a\\b\nc"}, 1.0),
                     ("vllm:num_requests_running", {}, math.inf)]
