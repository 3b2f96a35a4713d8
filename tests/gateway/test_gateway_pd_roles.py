"""Engine roles and the P/D decisions, without I/O: the config and admin rules for a role, the registry
entry a peer rebuilds an engine from, the skip decider, and the wire rules of the two legs."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from router_inprocess import call, make_router

from gateway.config import ConfigError, EngineConfig, load_config
from gateway.disaggregation.config import PdConfig
from gateway.disaggregation.decider import Member, choose, disaggregated
from gateway.disaggregation.wire import decode_body, expires_in, handoff_params, prefill_body
from gateway.fleet import registry_entry
from gateway.mesh_link import replicated_engine


def test_a_role_or_protocol_the_router_does_not_know_names_its_key(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text('[[engines]]\nurl = "http://127.0.0.1:9"\nrole = "decoder"\n')
    with pytest.raises(ConfigError, match=r"engines\[0\]\.role"):
        load_config(path, environ={})
    path.write_text('[[engines]]\nurl = "http://127.0.0.1:9"\nkv_protocol = "nixl"\n')
    with pytest.raises(ConfigError, match=r"engines\[0\]\.kv_protocol"):
        load_config(path, environ={})
    path.write_text('[pd]\nprefill_failover = "retry"\n')
    with pytest.raises(ConfigError, match=r"pd\.prefill_failover"):
        load_config(path, environ={})


def test_a_peer_rebuilds_an_engine_with_its_role_and_protocol():
    router = make_router()
    engine_id = router.fleet.add(EngineConfig(url="http://127.0.0.1:11", id="p", role="prefill",
                                              kv_protocol="opaque"))
    entry = json.loads(json.dumps(registry_entry(router.engines.get(engine_id))))
    rebuilt = replicated_engine("p", entry, None)
    assert (rebuilt.role, rebuilt.kv_protocol) == ("prefill", "opaque")
    with pytest.raises(ConfigError, match="role"):
        replicated_engine("p", {**entry, "role": ["prefill"]}, None)


async def test_the_admin_api_adds_an_engine_with_a_role_and_refuses_an_unknown_one():
    router = make_router()
    added = await call(router, "POST", "/admin/engines", json.dumps({"url": "http://127.0.0.1:12",
                                                                     "role": "decode"}).encode())
    assert added.status == 201 and added.json()["role"] == "decode" and added.json()["kv_protocol"] == "handoff"
    refused = await call(router, "POST", "/admin/engines", json.dumps({"url": "http://127.0.0.1:13",
                                                                       "role": "both-ish"}).encode())
    assert refused.status == 400 and refused.json()["error"]["param"] == "engine.role"


CONFIG = PdConfig(min_prefill_tokens=512, max_uncached_blocks=4)
P1, P2 = Member("p1", "prefill", "handoff"), Member("p2", "prefill", "opaque")
D1 = Member("d1", "decode", "handoff", overlap_tokens=0)


def test_the_decider_skips_the_prefill_leg_only_when_it_cannot_help():
    assert choose([D1, P1], 4000, 1, CONFIG).prefill == ["p1"]
    assert choose([D1, P1], 4000, 2, CONFIG).skipped == "n_above_1"
    assert choose([D1, P1], 300, 1, CONFIG).skipped == "short_prompt"
    holding = Member("d1", "decode", "handoff", overlap_tokens=4000 - 4 * 16)
    assert choose([holding, P1], 4000, 1, CONFIG).skipped == "decode_holds_prompt"
    assert choose([D1, P2], 4000, 1, CONFIG).skipped == "no_prefill_engine"  # no prefill speaks handoff
    assert choose([P1, P2], 4000, 1, CONFIG).decode == ["p1", "p2"]  # no decode engine up: serve whole
    assert choose([D1, P1], 0, 1, CONFIG).prefill == ["p1"]  # uncounted prompt: only n and pairing decide
    assert not disaggregated(["both", "decode"]) and disaggregated(["prefill", "both"])


@pytest.mark.parametrize("order", ["cost", "rotate", "ranked"])
def test_in_a_fleet_of_mixed_connectors_the_best_decode_engine_with_a_pair_takes_the_handoff(order):
    """The least-loaded decode engine speaks a protocol no prefill engine does: the next one that has a pair
    decodes (before, the request went whole to the first, skipped as no_prefill_engine)."""
    lonely = Member("d1", "decode", "handoff", load_s=0.1)
    paired = Member("d2", "decode", "opaque", load_s=0.5)
    choice = choose([lonely, paired, P2], 4000, 1, CONFIG, order)
    assert (choice.decode, choice.prefill, choice.protocol, choice.skipped) == (["d2", "d1"], ["p2"], "opaque", None)


def test_prefill_engines_are_ordered_by_their_estimated_prefill_not_by_whole_request_rank():
    busy_holder = Member("p1", "prefill", "handoff", overlap_tokens=3000, ttft_s=2.5)  # ranked first overall
    idle = Member("p2", "prefill", "handoff", overlap_tokens=0, ttft_s=0.4)
    assert choose([D1, busy_holder, idle], 4000, 1, CONFIG).prefill == ["p2", "p1"]


members = st.lists(st.builds(Member, st.sampled_from(["a", "b", "c", "d", "e"]),
                             st.sampled_from(["prefill", "decode", "both"]), st.sampled_from(["handoff", "opaque"]),
                             st.integers(0, 10_000)), min_size=1, max_size=6, unique_by=lambda m: m.id)


@given(members, st.integers(0, 10_000), st.integers(1, 4))
def test_a_prefill_leg_pairs_engines_of_one_protocol_and_never_the_decode_engine_itself(ranked, tokens, n):
    choice = choose(ranked, tokens, n, CONFIG)
    assert choice.decode, "some engine always serves the request"
    by_id = {m.id: m for m in ranked}
    assert (choice.skipped is None) == bool(choice.prefill)
    if choice.prefill:
        first = by_id[choice.decode[0]]
        assert n == 1 and first.id not in choice.prefill
        assert all(by_id[p].protocol == first.protocol and by_id[p].role != "decode" for p in choice.prefill)


def test_the_prefill_leg_asks_one_unstreamed_token_and_the_handoff():
    client = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True},
              "min_tokens": 4, "max_completion_tokens": 64, "n": 1, "kv_transfer_params": {"evil": 1}}
    leg = json.loads(prefill_body(client, "handoff"))
    assert leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1 and leg["stream"] is False
    assert "stream_options" not in leg and "min_tokens" not in leg and leg["n"] == 1
    assert leg["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert "kv_transfer_params" not in json.loads(prefill_body(client, "opaque"))
    assert "max_completion_tokens" not in json.loads(prefill_body({"model": "m"}, "opaque"))


def test_handoff_params_are_copied_unchanged_and_junk_is_refused():
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_blocks_expiry_time": 100.0}
    assert handoff_params(json.dumps({"kv_transfer_params": params}).encode()) == params
    for junk in (b"[1]", b"{", b'{"kv_transfer_params": null}', b'{"kv_transfer_params": []}',
                 json.dumps({"kv_transfer_params": {"x": "y" * 70_000}}).encode()):
        assert handoff_params(junk) is None
    assert expires_in(params, 99.0) == 1.0 and expires_in({"remote_blocks_expiry_time": None}, 0) is None
    client = {"model": "m", "kv_transfer_params": {"remote_host": "attacker"}}
    assert json.loads(decode_body(client, None)) == {"model": "m"}  # a client never hands its own params over
    assert json.loads(decode_body(client, params))["kv_transfer_params"] == params
