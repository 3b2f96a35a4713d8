"""Data-parallel rank pinning of a P/D pair (``X-data-parallel-rank``): the prefill rank chosen by what each
rank holds, both legs of a handoff pinned to it through the real proxy, and the router handing its index's
per-rank view to the choice."""

from __future__ import annotations

import json

from proxy_harness import Sink, completion, engine_state, start_server
from router_inprocess import MODEL, StubUpstream, call, make_router

from gateway.disaggregation.config import PdConfig
from gateway.disaggregation.decider import PdChoice
from gateway.disaggregation.flow import Disaggregation, PdRoute
from gateway.disaggregation.ranks import RANK_HEADER, pick_rank, pinned
from gateway.metrics import RouterMetrics
from gateway.proxy import forward
from index.holders import holder_keys
from index.prefix_index import PrefixIndex
from index.view import CacheView
from sim.http_server import HttpRequest, HttpResponse


def test_the_prefill_rank_is_the_one_holding_most_of_the_prompt_else_the_ranks_in_turn():
    assert pick_rank((), (), 0) is None and pick_rank((0,), (5,), 0) is None  # no data parallelism
    assert pick_rank((0, 1, 2), (1, 7, 3), 0) == 1
    assert [pick_rank((0, 1, 2), (2, 7, 7), turn) for turn in range(3)] == [1, 2, 1]  # the holders in turn
    assert [pick_rank((0, 1), (0, 0), turn) for turn in range(3)] == [0, 1, 0]  # cold: every rank in turn
    assert pick_rank((0, 1), (), 1) == 1  # nothing known about the prompt
    headers = [("content-type", "application/json"), (RANK_HEADER, "7")]  # a client's own pin is replaced
    assert pinned(headers, 1) == [("content-type", "application/json"), (RANK_HEADER, "1")]
    assert pinned(headers, None) == headers


def test_the_index_tells_each_ranks_share_of_the_prompt():
    view = CacheView(PrefixIndex())
    view.register("e", block_size=4, has_events=True)
    first, second = holder_keys("e", [0, 1])
    view.set_holders("e", (first, second))
    view.store.store(first, [(1, 11)])
    view.store.store(second, [(1, 11), (2, 12), (3, 13)])
    assert view.held_by_source("e", {4: [11, 12, 13, 14]}) == (1, 3)
    assert view.held_by_source("e", {16: [11]}) == () and view.held_by_source("gone", {4: [11]}) == ()


async def test_both_legs_of_a_handoff_are_pinned_to_the_prefill_rank(nursery):
    seen: dict[str, list[str | None]] = {"p1": [], "d1": [], "d2": []}

    def engine(name: str, answer: bytes):
        async def handle(req: HttpRequest) -> HttpResponse:
            seen[name].append(req.headers.get(RANK_HEADER))
            return HttpResponse(200, answer)
        return handle

    handoff = b'{"kv_transfer_params": {"do_remote_prefill": true, "remote_engine_id": "p1"}, "choices": []}'
    servers = {name: await start_server(nursery, engine(name, handoff if name == "p1" else b'{"choices": []}'))
               for name in seen}
    p1, d1, d2 = (engine_state(servers[name].url, name) for name in ("p1", "d1", "d2"))
    p1.dp_ranks, d1.dp_ranks = (0, 1), (0, 1)  # d2 has one rank: a pin to rank 1 would be refused there
    pd = Disaggregation(PdConfig(), RouterMetrics(), lambda *a: 0.0, lambda *a: None)
    body = {"prompt": "hi", "model": "m"}
    client_pin = [("content-type", "application/json"), (RANK_HEADER, "0")]
    for decode, expected in ((d1, "1"), (d2, "0")):
        route = PdRoute(PdChoice([decode.id], ["p1"], "handoff", None), [decode], [p1], {}, {"p1": 1})
        sink = Sink()
        await pd.serve(route, body, json.dumps(body).encode(), completion(sink, body, headers=client_pin),
                       forward, 2, True)
        assert sink.status == 200
        assert seen["p1"][-1] == "1" and seen[decode.id][-1] == expected  # d2 keeps the client's own header


async def test_the_router_pins_a_data_parallel_prefill_engine():
    upstream = StubUpstream()
    router = make_router(upstream)
    prefill, decode = router.engines.all()
    prefill.config.role, decode.config.role = "prefill", "decode"
    prefill.dp_ranks = (0, 1)
    router.planner.cache.set_holders(prefill.id, holder_keys(prefill.id, [0, 1]))
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": " ".join(["word"] * 1500)}]}
    answer = await call(router, "POST", "/v1/chat/completions", json.dumps(body).encode())
    assert answer.status == 200 and "outcome=disaggregated" in answer.headers["x-kvmesh-pd"]
    prefill_leg = upstream.calls[0]
    assert prefill_leg.headers_for is not None
    assert (RANK_HEADER, "0") in prefill_leg.headers_for(prefill, prefill_leg.headers)  # cold: the first turn
    body["messages"][0]["content"] = " ".join(["other"] * 1500)  # the first prompt: the decode engine holds it
    answer = await call(router, "POST", "/v1/chat/completions", json.dumps(body).encode())
    assert "outcome=disaggregated" in answer.headers["x-kvmesh-pd"]
    assert (RANK_HEADER, "1") in upstream.calls[2].headers_for(prefill, upstream.calls[2].headers)
