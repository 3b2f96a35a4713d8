"""The loop-lag watcher reports a stall of the event loop as at least the time the loop was held."""

import time

import trio

from gateway.loop_lag import watch_loop_lag


async def test_a_blocked_loop_is_reported_as_lag() -> None:
    observed: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_loop_lag, observed.append, 0.05)
        await trio.sleep(0.01)  # the watcher is asleep, due within 0.05 s
        time.sleep(0.3)  # hold the loop, as a long synchronous step would
        await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    assert max(observed) >= 0.24
    assert min(observed) >= 0.0


async def test_an_idle_loop_reports_every_interval() -> None:
    observed: list[float] = []
    with trio.move_on_after(0.5):
        await watch_loop_lag(observed.append, 0.05)
    assert 3 <= len(observed) <= 10
