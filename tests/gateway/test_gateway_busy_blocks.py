"""A request holds its prompt's blocks on its engine while in flight, and gives them back however it ends; its
expected end is noted there as long."""

from __future__ import annotations

import json

import trio
from router_inprocess import MODEL, StubUpstream, call, make_router

from gateway.proxy import UpstreamFailure

CHAT = "/v1/chat/completions"


def chat(text: str) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 64, "stream": True,
                       "messages": [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]}).encode()


class Watching(StubUpstream):
    """Notes what the planner holds on the engine while the request is being answered there."""

    held: int = -1
    ends: tuple[float, ...] = ()

    async def __call__(self, engines, exchange, max_attempts):
        self.held = self.router.planner.busy.held(engines[0].id)
        self.ends = self.router.planner.ends.remaining(engines[0].id, trio.current_time())
        return await super().__call__(engines, exchange, max_attempts)


async def test_a_request_holds_blocks_while_answered_and_releases_them_after():
    upstream = Watching()
    router = make_router(upstream)
    upstream.router = router
    answer = await call(router, "POST", CHAT, chat("word " * 400))
    assert answer.status == 200
    assert upstream.held >= 400 // 16  # the prompt's blocks and the expected answer's
    assert len(upstream.ends) == 1 and upstream.ends[0] > 0  # due after its estimated time to the last token
    assert all(router.planner.busy.held(e.id) == 0 for e in router.engines.all())
    assert all(router.planner.ends.remaining(e.id, trio.current_time()) == () for e in router.engines.all())


async def test_a_failed_request_releases_its_blocks_too():
    upstream = Watching(error=UpstreamFailure(502, "engine failed"))
    router = make_router(upstream)
    upstream.router = router
    answer = await call(router, "POST", CHAT, chat("word " * 400))
    assert answer.status >= 500 and upstream.held > 0 and len(upstream.ends) == 1
    assert all(router.planner.busy.held(e.id) == 0 for e in router.engines.all())
    assert all(router.planner.ends.remaining(e.id, trio.current_time()) == () for e in router.engines.all())
