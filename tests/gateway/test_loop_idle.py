"""The loop-idle instrument counts the time the trio loop blocks waiting for I/O, and not the time a task holds it."""

import time

import trio

from gateway.loop_idle import LoopIdle


async def test_a_sleeping_loop_is_idle_and_a_held_one_is_not() -> None:
    idle = LoopIdle()
    trio.lowlevel.add_instrument(idle)
    try:
        await trio.sleep(0.3)  # nothing else to run: the loop waits for its timer
        asleep = idle.idle_s
        time.sleep(0.3)  # a task holds the loop
        await trio.lowlevel.checkpoint()
        held = idle.idle_s - asleep
    finally:
        trio.lowlevel.remove_instrument(idle)
    assert asleep >= 0.25
    assert held < 0.1
