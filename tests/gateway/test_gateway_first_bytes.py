"""An engine's event ingest lets that engine's pending first bytes go first, for a bounded time."""

from __future__ import annotations

import trio
import trio.testing

from gateway.first_bytes import FIRST_BYTE_GRACE_S, PendingFirstBytes


async def _waited(pending: PendingFirstBytes, during) -> float:
    """Seconds ``let_first_bytes_pass`` took while ``during`` ran beside it."""
    took = -1.0

    async def ingest() -> None:
        nonlocal took
        began = trio.current_time()
        await pending.let_first_bytes_pass()
        took = trio.current_time() - began

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ingest)
        await during()
    return took


async def test_ingest_goes_ahead_at_once_when_no_first_byte_is_pending(autojump_clock):
    async def nothing() -> None:
        await trio.sleep(0)

    assert await _waited(PendingFirstBytes(), nothing) == 0


async def test_ingest_waits_for_a_pending_first_byte_and_goes_when_it_arrives(autojump_clock):
    pending = PendingFirstBytes()
    arrived = pending.wait_for_one()

    async def first_byte_after_a_millisecond() -> None:
        await trio.sleep(0.001)
        arrived()
        arrived()  # idempotent: the attempt's own cleanup calls it again
        assert pending.count == 0

    assert await _waited(pending, first_byte_after_a_millisecond) == 0.001


async def test_ingest_never_waits_longer_than_the_grace_for_a_first_byte_that_does_not_come(autojump_clock):
    pending = PendingFirstBytes()
    pending.wait_for_one()

    async def idle() -> None:
        await trio.sleep(1)

    assert await _waited(pending, idle) == FIRST_BYTE_GRACE_S
