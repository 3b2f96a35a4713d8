"""What one request may cost the router: a body must arrive in time, and long keys are hashed cheaply."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st
from router_inprocess import MODEL, InlineTokenizers, StubUpstream, assert_openai_error, call, make_router

from gateway import router as router_module
from gateway.body_limits import LimitsConfig
from gateway.request_body import parse_request
from gateway.route_planner import (
    DEFER_CHARS,
    MAX_KEY_CHARS,
    bounded_key,
    head_decides,
    head_holders,
    request_prefix_key,
)
from gateway.security.config import AuthConfig, TenantConfig
from gateway.security.keys import hash_key
from index.view import CacheOverlap
from tokenization.service import DeferredIds
from tokenization.worker import TokenizerBusy


async def test_a_trickling_body_gets_a_408(monkeypatch, autojump_clock):
    router = make_router(limits=LimitsConfig(body_timeout_s=30))
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}
    chunks = [{"type": "http.request", "body": b'{"model": "m", ', "more_body": True}]
    sent = []

    async def receive():
        if chunks:
            return chunks.pop()
        await trio.sleep_forever()

    async def send(message):
        sent.append(message)

    started = trio.current_time()
    await router(scope, receive, send)
    assert trio.current_time() - started >= 30
    assert sent[0]["status"] == 408
    assert json.loads(sent[1]["body"])["error"]["code"] == "body_timeout"


def test_long_session_keys_become_short_digests():
    assert bounded_key(None) is None and bounded_key("alice") == "alice"
    assert bounded_key("a" * MAX_KEY_CHARS) == "a" * MAX_KEY_CHARS
    first, second = bounded_key("u" * 4_000_000), bounded_key("u" * 3_999_999 + "v")
    assert len(first) <= MAX_KEY_CHARS and first != second and first == bounded_key("u" * 4_000_000)


async def test_a_multi_megabyte_user_routes_by_session_quickly(monkeypatch):
    router = make_router(policy="session")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "user": "u" * 4_000_000}
    started = time.perf_counter()
    answer = await call(router, "POST", "/v1/chat/completions", json.dumps(body).encode())
    print(f"4 MB user routed in {(time.perf_counter() - started) * 1000:.0f} ms")
    assert answer.status == 200 and "session-sticky" in answer.headers["x-kvmesh-route"]
    body["user"] = 5
    assert_openai_error(await call(router, "POST", "/v1/chat/completions", json.dumps(body).encode()), 400)


items = st.integers(0, 10**6) | st.text(max_size=3) | st.lists(st.integers(0, 9), max_size=2)


@given(st.lists(items, min_size=1, max_size=300))
def test_the_completion_prefix_key_reads_only_the_first_items(prompt):
    parsed = parse_request(json.dumps({"model": "m", "prompt": "x"}).encode(), "completion")
    body = {**parsed.body, "prompt": prompt}
    expected = f"m\x1f\x1f{str(prompt)[:256]}"
    assert request_prefix_key(dataclasses.replace(parsed, body=body)) == expected


async def test_debug_route_is_admitted_and_charged_like_a_request(monkeypatch):
    key = "kvm-debugger"
    tenant = TenantConfig("debugger", keys=[hash_key(key)], requests_per_second=1.0)
    router = make_router(auth=AuthConfig(enabled=True, admin_keys=[hash_key(key)]), tenants=[tenant])
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert (await call(router, "POST", "/debug/route", body, headers)).status == 200
    refused = await call(router, "POST", "/debug/route", body, headers)
    assert assert_openai_error(refused, 429)["code"] and "retry-after" in refused.headers


async def test_the_ttft_model_is_refit_after_an_answer_not_in_the_next_decision(monkeypatch):
    """The lazy refit after an observation used to run inside the next request's routing decision."""
    router = make_router(policy="kv_aware")
    learner = router.planner.policy.costs.learner
    body = json.dumps({"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert (await call(router, "POST", "/v1/chat/completions", body)).status == 200
    assert learner._models and not learner._stale


STREAMED_CHAT = json.dumps({"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]}).encode()


class HeadFirst(InlineTokenizers):
    """Defers every prompt: ``head`` routes it, and encoding the rest (logged in ``log``) gives ``ids``."""

    def __init__(self, head: int, ids: int, rest_chars: int, log: list[str]) -> None:
        super().__init__()
        self.head, self.ids, self.rest_chars, self.log = list(range(head)), list(range(ids)), rest_chars, log

    async def token_ids_or_head(self, model, body, kind, defer_chars):
        async def complete():
            self.log.append("encoded")
            return self.ids
        return DeferredIds(self.head, len(self.ids), complete, rest_chars=self.rest_chars)


async def test_a_deferred_prompt_is_routed_on_its_head_and_its_rest_encoded_once_it_is_asked_for(monkeypatch):
    """The rest is encoded only once the answer has begun: started with the request, its CPU competed with
    the engine's prefill."""
    router = make_router(policy="kv_aware")
    planner = router.planner
    log: list[str] = []
    planner.tokenizers = HeadFirst(40, 5000, DEFER_CHARS, log)
    parsed = parse_request(STREAMED_CHAT, "chat", LimitsConfig())
    async with trio.open_nursery() as nursery:
        planner._background = nursery
        plan = await planner.plan(parsed, {})
        await trio.testing.wait_all_tasks_blocked()
        assert not log
        planner.encode_rest(plan)
        planner.encode_rest(plan)
        await trio.testing.wait_all_tasks_blocked()
        assert log == ["encoded"] and plan.unencoded is None
    assert (plan.prompt_tokens, plan.counted_tokens, plan.estimated) == (5000, 0, True)
    assert all(len(blocks) == 40 // size for size, blocks in plan.chains.items())
    assert plan.decision.prompt_tokens == 5000


def _overlap(blocks: int) -> CacheOverlap:
    return CacheOverlap(blocks, blocks, 1.0, 16)


@pytest.mark.parametrize(("held", "chosen", "decides"), [
    ({"a": 1, "b": 2}, ["a"], True),             # nobody holds the whole head: nothing past it is cached
    ({"a": 3, "b": 1}, ["a"], True),             # the one holder was chosen anyway
    ({"a": 3, "b": 1}, ["b"], False),            # more cached tokens could pull the request to the holder
    ({"a": 3, "b": 3}, ["a"], False),            # the rest may be cached on either holder
])
def test_the_cached_head_decides_only_when_the_fresh_rest_cannot_change_the_engine(held, chosen, decides):
    chains = {16: [11, 12, 13]}
    assert head_decides(head_holders(chains, {e: _overlap(n) for e, n in held.items()}), chosen) is decides
    assert not head_decides(head_holders({16: []}, {e: _overlap(0) for e in held}), chosen)


async def test_a_short_fresh_rest_is_encoded_before_routing_when_two_engines_hold_the_head(monkeypatch):
    router = make_router(policy="kv_aware")
    planner = router.planner
    log: list[str] = []
    planner.tokenizers = HeadFirst(64, 400, 1500, log)
    parsed = parse_request(STREAMED_CHAT, "chat", LimitsConfig())
    async with trio.open_nursery() as nursery:
        planner._background = nursery
        alone = await planner.plan(parsed, {})
        assert alone.estimated and alone.unencoded is not None and not log  # decided: encoded after, not before
        for engine in router.engines.all():
            planner.cache.record_dispatch(engine.id, alone.chains, trio.current_time())
        shared = await planner.plan(parsed, {})
    assert log == ["encoded"]
    assert (shared.estimated, shared.prompt_tokens, shared.unencoded) == (False, 400, None)
    assert all(len(blocks) == 400 // size for size, blocks in shared.chains.items())


class FreshHead(HeadFirst):
    """Defers every prompt as one whose first segment was never seen (``DeferredIds.fresh``)."""

    async def token_ids_or_head(self, model, body, kind, defer_chars):
        found = await super().token_ids_or_head(model, body, kind, defer_chars)
        return dataclasses.replace(found, fresh=True)


@pytest.mark.parametrize("tokenizers", [HeadFirst, FreshHead])
async def test_a_prompt_routed_on_its_head_has_its_rest_encoded_once_asked_for(tokenizers, monkeypatch):
    """A new system prompt's first request (``FreshHead``) goes out on its head's blocks, and so does a turn whose
    cached head decided its engine (``HeadFirst``); either's rest is encoded once the answer has begun (and only
    once), so the next request of the prefix or conversation is routed on all its blocks. Left unencoded, an
    agentic session's later turns saw only their first turn cached (1.8-1.9k tokens where the engine held
    2.5-4.5k), and once their uncached history outgrew ``DEFER_CHARS`` were routed on that alone and left their
    engine for an idle one."""
    router = make_router(policy="kv_aware")
    planner = router.planner
    log: list[str] = []
    planner.tokenizers = tokenizers(64, 400, 1500, log)
    async with trio.open_nursery() as nursery:
        planner._background = nursery
        plan = await planner.plan(parse_request(STREAMED_CHAT, "chat", LimitsConfig()), {})
        assert plan.estimated and plan.unencoded is not None and not log
        planner.encode_rest(plan)
        planner.encode_rest(plan)  # once only: the router calls it at the first token and again at the end
    assert log == ["encoded"]


def _new_prefix_router(tokenizers: type[FreshHead]):
    """A kv_aware router whose prompts are all new (400 tokens, routed on a 64-token head), and its encode log."""
    router = make_router(policy="kv_aware")
    log: list[str] = []
    router.planner.tokenizers = tokenizers(64, 400, 1500, log)
    return router, router.planner, log


def _only_on(router, engine: str, blocks: int) -> dict[str, int]:
    return {e.id: blocks if e.id == engine else 0 for e in router.engines.all()}


async def test_a_new_prefix_is_encoded_at_dispatch_and_recorded_whole_where_it_went(monkeypatch):
    """Recorded by its head alone until its answer began (a sixth of a 3.9k-token prompt), its engine did not look
    like it held the prompt to siblings arriving during its prefill, which left to compute it again elsewhere."""
    router, planner, log = _new_prefix_router(FreshHead)
    async with trio.open_nursery() as nursery:
        planner._background = nursery
        plan = await planner.plan(parse_request(STREAMED_CHAT, "chat", LimitsConfig()), {})
        planner.dispatched(plan)
        await trio.testing.wait_all_tasks_blocked()
        assert log == ["encoded"] and plan.unencoded is None and not planner._computing
        planner.encode_rest(plan)
    assert log == ["encoded"]
    ids = [e.id for e in router.engines.all()]
    found = planner.cache.overlaps(planner._chains(plan.parsed, list(range(400)), ids), ids, trio.current_time())
    assert {e: o.approx_blocks for e, o in found.items()} == _only_on(router, plan.engines[0].id, 400 // 16)


class SlowFreshHead(FreshHead):
    """A fresh head whose rest is encoded only once ``go`` is set (the encode of the first request is still running)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.go = trio.Event()

    async def token_ids_or_head(self, model, body, kind, defer_chars):
        found = await super().token_ids_or_head(model, body, kind, defer_chars)

        async def complete():
            await self.go.wait()
            return await found.complete()
        return dataclasses.replace(found, complete=complete)


async def test_a_sibling_arriving_while_a_new_prefix_is_encoded_waits_for_its_whole_record(monkeypatch):
    """Siblings of a new prompt arriving at once (seed 0 suite shape #3) are routed on its whole record."""
    router, planner, log = _new_prefix_router(SlowFreshHead)
    plans = []
    async with trio.open_nursery() as nursery:
        planner._background = nursery
        first = await planner.plan(parse_request(STREAMED_CHAT, "chat", LimitsConfig()), {})
        planner.dispatched(first)

        async def sibling():
            plans.append(await planner.plan(parse_request(STREAMED_CHAT, "chat", LimitsConfig()), {}))

        nursery.start_soon(sibling)
        await trio.testing.wait_all_tasks_blocked()
        assert not plans and planner._computing == [first]
        planner.tokenizers.go.set()
    assert log == ["encoded", "encoded"] and not planner._computing
    sibling_plan, = plans
    assert (sibling_plan.estimated, sibling_plan.prompt_tokens) == (False, 400)
    chosen = first.engines[0].id
    assert sibling_plan.decision.chosen == chosen
    assert {s.engine: s.approx_tokens for s in sibling_plan.decision.table} == _only_on(router, chosen, 400)


class StalledFreshHeadEncodableNow(SlowFreshHead):
    """Its rest's encode in the background never finishes (``go`` is never set), but it can be encoded at once on
    the loop (``DeferredIds.complete_now``, logged as ``now``)."""

    async def token_ids_or_head(self, model, body, kind, defer_chars):
        found = await super().token_ids_or_head(model, body, kind, defer_chars)

        def complete_now():
            self.log.append("now")
            return self.ids
        return dataclasses.replace(found, complete_now=complete_now)


async def test_a_sibling_encodes_a_new_prefixs_short_rest_on_the_loop_instead_of_waiting(monkeypatch):
    """The first sibling of a new prompt does not wait for the thread's encode and the task recording it: it
    encodes the rest on the loop, the prompt is recorded whole where it went, and the sibling routes on that."""
    router, planner, log = _new_prefix_router(StalledFreshHeadEncodableNow)
    async with trio.open_nursery() as nursery:
        planner._background = nursery
        first = await planner.plan(parse_request(STREAMED_CHAT, "chat", LimitsConfig()), {})
        planner.dispatched(first)
        with trio.fail_after(5):
            sibling = await planner.plan(parse_request(STREAMED_CHAT, "chat", LimitsConfig()), {})
        assert log == ["now", "now"] and not planner._computing and first.fresh_rest is None  # its own: cached
        nursery.cancel_scope.cancel()  # the stalled background encode
    assert (sibling.estimated, sibling.prompt_tokens) == (False, 400)
    chosen = first.engines[0].id
    assert sibling.decision.chosen == chosen
    assert {s.engine: s.approx_tokens for s in sibling.decision.table} == _only_on(router, chosen, 400)


async def test_a_long_new_prefix_whose_head_two_engines_hold_is_encoded_before_routing(monkeypatch):
    """A prompt new to this router but not to the fleet (another replica sent it): its head alone would credit
    its holders a fraction of what they hold, so it is encoded first, however long."""
    router = make_router(policy="kv_aware")
    planner = router.planner
    log: list[str] = []
    planner.tokenizers = FreshHead(64, 5000, DEFER_CHARS * 2, log)
    async with trio.open_nursery() as nursery:
        planner._background = nursery
        first = await planner.plan(parse_request(STREAMED_CHAT, "chat", LimitsConfig()), {})
        for engine in router.engines.all():
            planner.cache.record_dispatch(engine.id, first.chains, trio.current_time())
        shared = await planner.plan(parse_request(STREAMED_CHAT, "chat", LimitsConfig()), {})
    assert log == ["encoded"]
    assert (shared.estimated, shared.prompt_tokens, shared.unencoded) == (False, 5000, None)


@pytest.mark.parametrize("policy", ["approximate", "kv_aware_without_events"])
async def test_a_short_fresh_rest_is_encoded_first_where_the_router_only_knows_what_it_sent(monkeypatch, policy):
    """Without events the router knows an engine's cache only by the blocks it recorded sending there: an
    unencoded rest would never be recorded, and the conversation's next turn could not find its engine."""
    router = make_router(policy=policy.removesuffix("_without_events"))
    planner = router.planner
    if policy.endswith("_without_events"):
        engine = router.engines.all()[0]
        planner.register_engine(engine, has_events=False)
    log: list[str] = []
    planner.tokenizers = HeadFirst(64, 400, 1500, log)
    async with trio.open_nursery() as nursery:
        planner._background = nursery
        plan = await planner.plan(parse_request(STREAMED_CHAT, "chat", LimitsConfig()), {})
    assert log == ["encoded"]
    assert (plan.estimated, plan.prompt_tokens) == (False, 400)


async def test_the_router_encodes_a_deferred_rest_once_the_answer_head_goes_out(monkeypatch):
    log: list[str] = []

    class Watching(StubUpstream):
        async def __call__(self, engines, exchange, max_attempts):
            log.append("head")
            return await super().__call__(engines, exchange, max_attempts)

    router = make_router(upstream=Watching(), policy="kv_aware")
    router.planner.tokenizers = HeadFirst(40, 5000, DEFER_CHARS, log)
    encode_rest = router.planner.encode_rest

    def asked(plan):
        log.append("asked")
        encode_rest(plan)

    monkeypatch.setattr(router.planner, "encode_rest", asked)
    async with trio.open_nursery() as nursery:
        router.planner._background = nursery
        assert (await call(router, "POST", "/v1/chat/completions", STREAMED_CHAT)).status == 200
    assert log[:2] == ["head", "asked"] and log.count("encoded") == 1


async def test_a_tokenizer_queue_full_of_the_tenants_own_prompts_is_a_429_and_a_late_one_a_503(monkeypatch):
    router = make_router(policy="kv_aware")
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "long"}]}).encode()
    for own_load, status in ((True, 429), (False, 503)):
        async def busy(*args, own_load=own_load, **kwargs):
            raise TokenizerBusy("the tokenizer is busy", own_load)

        monkeypatch.setattr(router.planner.tokenizers, "token_ids", busy)
        answer = await call(router, "POST", "/v1/chat/completions", body)
        assert assert_openai_error(answer, status)["code"] == "tokenizer_busy"
        assert answer.headers["retry-after"] == "1"


class RefusedRest(HeadFirst):
    """Defers every prompt, and the worker pool refuses to encode the rest (the tenant's queue is full)."""

    async def token_ids_or_head(self, model, body, kind, defer_chars):
        async def complete():
            self.log.append("refused")
            raise TokenizerBusy("8 long prompts of this requester are already waiting", True)
        return DeferredIds(self.head, len(self.ids), complete, rest_chars=self.rest_chars)


async def test_a_refused_background_encode_is_counted_and_the_router_keeps_serving(monkeypatch):
    """The rest of a long prompt is encoded after the request went out, in the planner's background nursery:
    a refusal there used to cancel that nursery, which ends the router process."""
    log: list[str] = []
    router = make_router(policy="kv_aware")
    router.planner.tokenizers = RefusedRest(40, 5000, DEFER_CHARS, log)
    failures = router.metrics.background_encode_failures.labels("TokenizerBusy")
    async with trio.open_nursery() as nursery:
        router.planner._background = nursery
        for _ in range(12):
            assert (await call(router, "POST", "/v1/chat/completions", STREAMED_CHAT)).status == 200
    assert log.count("refused") == 12
    assert failures._value.get() == 12


async def test_a_tenant_over_its_rate_limit_is_refused_before_its_body_is_parsed(monkeypatch):
    """An 8 MiB body costs the loop a parse: a tenant over its limit gets its 429 first (it got the body's
    400 before), and the rest of its body is still read so that the client sees the answer."""
    key = "kvm-flooder"
    tenant = TenantConfig("flooder", keys=[hash_key(key)], requests_per_second=1.0)
    router = make_router(auth=AuthConfig(enabled=True), tenants=[tenant])
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
    malformed = [b'{"model": "m", "messages": [', b"x" * 1024]
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert (await call(router, "POST", "/v1/chat/completions", body, headers)).status == 200
    parsed = []
    monkeypatch.setattr(router_module, "parse_request", lambda *args: parsed.append(args) or None)
    refused = await call(router, "POST", "/v1/chat/completions", malformed, headers)
    assert assert_openai_error(refused, 429)["code"] == "rate_limit_exceeded"
    assert parsed == [] and refused.unread == 0


async def test_every_prompt_of_a_completions_batch_is_charged_to_the_tenant(monkeypatch):
    """Routing reads the first prompt; the tenant's token budget paid for that one only."""
    key = "kvm-batcher"
    tenant = TenantConfig("batcher", keys=[hash_key(key)], prompt_tokens_per_minute=60)
    router = make_router(auth=AuthConfig(enabled=True), tenants=[tenant])
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
    prompt = "one two three four five six seven eight nine ten"
    tokens = len(InlineTokenizers().tokenizer.hf.encode(prompt))
    assert 4 <= tokens <= 30
    batch = json.dumps({"model": MODEL, "prompt": [prompt] * 8, "max_tokens": 1}).encode()
    refused = await call(router, "POST", "/v1/completions", batch, headers)
    assert assert_openai_error(refused, 429)["code"] == "rate_limit_exceeded", "8 prompts fit a 60-token budget"
    single = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    assert (await call(router, "POST", "/v1/completions", single, headers)).status == 200


async def test_the_detailed_route_header_says_how_long_the_decision_took():
    """The bench's per-request logs read it to tell a slow decision from a slow engine."""
    router = make_router(policy="kv_aware")
    answer = await call(router, "POST", "/v1/chat/completions", STREAMED_CHAT)
    assert answer.status == 200
    field = next(f for f in answer.headers["x-kvmesh-route"].split("; ") if f.startswith("decide_ms="))
    assert float(field.removeprefix("decide_ms=")) >= 0
