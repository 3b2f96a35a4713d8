"""The suite's wait for a quiet machine: busy CPU read from /proc/stat, and when a run may start."""

from __future__ import annotations

import os

import trio
import trio.testing

from bench.settle import busy_cores, cpu_times, quiet, until_quiet

STAT = "cpu  100 5 50 800 20 1 2 3 0 0\ncpu0 50 2 25 400 10 0 1 1 0 0\n"


def test_cpu_times_count_iowait_as_idle_and_leave_guest_time_out():
    busy, total = cpu_times(STAT)
    assert total == 100 + 5 + 50 + 800 + 20 + 1 + 2 + 3
    assert busy == total - 800 - 20


def test_busy_cores_scale_the_busy_share_of_the_jiffies_by_the_cores():
    assert busy_cores((100, 1000), (150, 1100), cores=2) == 1.0
    assert busy_cores((100, 1000), (100, 1000), cores=2) == 0.0


def test_a_start_up_that_is_still_falling_is_not_quiet_and_a_steady_background_is():
    assert not quiet([])
    assert quiet([1.6, 0.4])
    assert not quiet([1.8, 1.2, 0.9])
    assert quiet([1.8, 0.80, 0.75, 0.85])
    assert not quiet([0.9, 0.6, 0.9])


def _samples(busy_per_window: list[float], cores: int) -> list[tuple[int, int]]:
    """``cpu_times`` samples two per window (before and after), 100 jiffies a window."""
    out = []
    busy = total = 0
    for share in busy_per_window:
        out.append((busy, total))
        busy, total = busy + round(100 * share / cores), total + 100
        out.append((busy, total))
    return out


def _wait(busy_per_window: list[float], timeout_s: float) -> tuple[float, float]:
    cores = os.cpu_count() or 1
    samples = iter(_samples(busy_per_window, cores))

    async def main() -> tuple[float, float]:
        return await until_quiet(window_s=0.5, timeout_s=timeout_s, sample=lambda: next(samples))

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_wait_ends_at_the_first_quiet_window_or_at_its_timeout():
    waited, busy = _wait([1.9, 1.4, 0.9, 0.4, 1.9], timeout_s=15.0)
    assert waited == 2.0 and abs(busy - 0.4) < 0.05
    waited, _ = _wait([1.9, 1.0, 1.9, 1.0, 1.9, 1.0], timeout_s=2.0)
    assert waited == 2.0


def test_nothing_is_waited_for_where_the_machine_cannot_be_read():
    async def main() -> tuple[float, float]:
        return await until_quiet(sample=lambda: None)

    assert trio.run(main) == (0.0, 0.0)
