"""The prompt tokens still prefilling for a router's streams reach its next decisions (and only a lone router's)."""

from __future__ import annotations

import json

from router_inprocess import MODEL, StubUpstream, call, make_router

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "what is still prefilling " * 40}],
        "stream": True}


def _ahead(answer) -> dict[str, int]:
    return {row["engine"]: row["prefill_ahead_tokens"] for row in answer.json()["candidates"]}


async def test_a_stream_hands_the_proxy_each_engines_priced_prompt_and_later_decisions_see_it_pending():
    upstream = StubUpstream()
    router = make_router(upstream)
    assert (await call(router, "POST", "/v1/chat/completions", json.dumps(CHAT).encode())).status == 200
    (exchange,) = upstream.calls
    decided = (await call(router, "POST", "/debug/route", json.dumps(CHAT).encode())).json()["candidates"]
    engines = {e.id: e for e in router.engines.all()}
    priced = {row["engine"]: row["uncached_tokens"] for row in decided}
    assert all(priced.values()) and {e: exchange.prefill_tokens(engines[e]) for e in priced} == priced

    first, second = engines.values()
    went_out = first.first_tokens.wait_for_one(exchange.prefill_tokens(first))  # what the proxy does per attempt
    pending = _ahead(await call(router, "POST", "/debug/route", json.dumps(CHAT).encode()))
    assert pending == {first.id: priced[first.id], second.id: 0}
    router.planner.prices_prefill_ahead = False  # as the mesh link sets it for a meshed replica
    assert set(_ahead(await call(router, "POST", "/debug/route", json.dumps(CHAT).encode())).values()) == {0}
    router.planner.prices_prefill_ahead = True
    went_out()
    assert set(_ahead(await call(router, "POST", "/debug/route", json.dumps(CHAT).encode())).values()) == {0}


async def test_the_ttft_learner_is_taught_with_the_prompts_ahead_beside_the_requests_own():
    """A first token that came after other streams' prefills is what those prefills and its own took: the learner
    gets both token counts as one, so it does not learn the queue of misses as a few ms per request."""
    router = make_router(StubUpstream())
    taught: list[tuple[str, float, int]] = []
    policy = router.planner.policy
    policy.observe = lambda engine, tokens, depth, ttft: taught.append((engine, tokens, depth)) or True
    engines = router.engines.all()
    for engine in engines:
        engine.first_tokens.wait_for_one(2500)
    decided = (await call(router, "POST", "/debug/route", json.dumps(CHAT).encode())).json()["candidates"]
    assert (await call(router, "POST", "/v1/chat/completions", json.dumps(CHAT).encode())).status == 200
    (engine, tokens, depth), = taught
    row = next(r for r in decided if r["engine"] == engine)
    assert row["prefill_ahead_tokens"] == 2500 and tokens == row["uncached_tokens"] + 2500
