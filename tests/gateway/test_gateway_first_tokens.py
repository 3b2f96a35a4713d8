"""An engine's event ingest lets that engine's pending first tokens go first, for a bounded time."""

from __future__ import annotations

import trio
import trio.testing

from gateway.first_tokens import FIRST_TOKEN_GRACE_S, PendingFirstTokens


async def _waited(pending: PendingFirstTokens, during) -> float:
    """Seconds ``let_first_tokens_pass`` took while ``during`` ran beside it."""
    took = -1.0

    async def ingest() -> None:
        nonlocal took
        began = trio.current_time()
        await pending.let_first_tokens_pass()
        took = trio.current_time() - began

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ingest)
        await during()
    return took


async def test_ingest_goes_ahead_at_once_when_no_first_token_is_pending(autojump_clock):
    async def nothing() -> None:
        await trio.sleep(0)

    assert await _waited(PendingFirstTokens(), nothing) == 0


async def test_ingest_waits_for_a_pending_first_token_and_goes_once_it_is_out(autojump_clock):
    pending = PendingFirstTokens()
    went_out = pending.wait_for_one()

    async def first_token_after_a_millisecond() -> None:
        await trio.sleep(0.001)
        went_out()
        went_out()  # idempotent: the attempt's own cleanup calls it again
        assert pending.count == 0

    assert await _waited(pending, first_token_after_a_millisecond) == 0.001


async def test_ingest_never_waits_longer_than_the_grace_for_a_first_token_that_does_not_come(autojump_clock):
    pending = PendingFirstTokens()
    pending.wait_for_one()

    async def idle() -> None:
        await trio.sleep(1)

    assert await _waited(pending, idle) == FIRST_TOKEN_GRACE_S
