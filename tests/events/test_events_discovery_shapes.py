"""What an engine says about itself is shape-checked: over arbitrary JSON the discovery parsers return a
well-formed value or raise ValueError, never anything else (which would end the engine's watcher)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.discovery import EventSource, parse_kv_event_sources, parse_models

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)
SOURCE = st.fixed_dictionaries({}, optional={
    "enable_kv_cache_events": st.booleans() | JSON, "publisher": st.just("zmq") | JSON,
    "endpoint": st.sampled_from(["tcp://*:5557", "tcp://10.0.0.1:65535", "tcp://h:x", "tcp://a b:1"]) | JSON,
    "replay_endpoint": st.sampled_from(["tcp://*:5558", None]) | JSON, "topic": st.text() | JSON})
SOURCES = st.dictionaries(st.sampled_from(["0", "1", "01", "-1", "4097", "x", "\u0663"]) | st.text(max_size=3),
                          SOURCE | JSON, max_size=4)


@settings(max_examples=300)
@given(JSON | st.fixed_dictionaries({"data": JSON | st.lists(st.fixed_dictionaries({"id": JSON}))}))
def test_model_list_parser_returns_ids_or_raises_value_error(data):
    try:
        models = parse_models(json.dumps(data)).ids
    except ValueError:
        return
    assert all(isinstance(m, str) and m for m in models)


@settings(max_examples=300)
@given(JSON | SOURCES)
def test_event_source_parser_returns_usable_sources_or_raises_value_error(data):
    try:
        sources = parse_kv_event_sources(json.dumps(data), "http://engine:8000")
    except ValueError:
        return
    for source in sources:
        source.topic.encode("utf-8")
        assert source.endpoint.isascii() and 0 < int(source.endpoint.rpartition(":")[2]) <= 65535


@pytest.mark.parametrize("body", [b'{"data": 5}', b'{"data": {}}', b"[1]", b"null", b"\xff", b"[" * 100_000])
def test_malformed_model_lists_are_value_errors(body):
    with pytest.raises(ValueError):
        parse_models(body)


def test_a_model_list_of_null_means_no_models_yet():
    assert parse_models(b'{"object": "list", "data": null}').ids == set()
    assert parse_models(b'{"data": [{"id": "m"}, {"id": 5}, "x", {"id": ""}]}').ids == {"m"}


@pytest.mark.parametrize("body", [
    b"{" * 50_000,
    b'{"0": {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "\\ud800"}}',
    b'{"0": {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": ["kv"]}}',
    b'{"1": {"enable_kv_cache_events": true, "endpoint": "tcp://*:65535"}}',
    b'{"1": {}, "01": {}}',
    b'{"0": {"enable_kv_cache_events": true, "endpoint": {"a": 1}}}',
])
def test_unusable_event_sources_are_value_errors(body):
    with pytest.raises(ValueError):
        parse_kv_event_sources(body, "http://engine:8000")


def test_an_event_source_refuses_a_topic_the_subscriber_could_not_encode():
    with pytest.raises(ValueError, match="UTF-8"):
        EventSource("tcp://10.0.0.1:5557", None, "\ud800")
