"""A request holds its prompt's blocks on its engine while in flight, and gives them back however it ends."""

from __future__ import annotations

import json

from router_inprocess import MODEL, StubUpstream, call, make_router

from gateway.proxy import UpstreamFailure

CHAT = "/v1/chat/completions"


def chat(text: str) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 64, "stream": True,
                       "messages": [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]}).encode()


class Watching(StubUpstream):
    """Notes what the planner holds on the engine while the request is being answered there."""

    held: int = -1

    async def __call__(self, engines, exchange, max_attempts):
        self.held = self.router.planner.busy.held(engines[0].id)
        return await super().__call__(engines, exchange, max_attempts)


async def test_a_request_holds_blocks_while_answered_and_releases_them_after():
    upstream = Watching()
    router = make_router(upstream)
    upstream.router = router
    answer = await call(router, "POST", CHAT, chat("word " * 400))
    assert answer.status == 200
    assert upstream.held >= 400 // 16  # the prompt's blocks and the expected answer's
    assert all(router.planner.busy.held(e.id) == 0 for e in router.engines.all())


async def test_a_failed_request_releases_its_blocks_too():
    upstream = Watching(error=UpstreamFailure(502, "engine failed"))
    router = make_router(upstream)
    upstream.router = router
    answer = await call(router, "POST", CHAT, chat("word " * 400))
    assert answer.status >= 500 and upstream.held > 0
    assert all(router.planner.busy.held(e.id) == 0 for e in router.engines.all())
