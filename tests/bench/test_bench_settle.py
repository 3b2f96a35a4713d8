"""The suite's wait for a quiet machine: busy CPU read from /proc/stat, and when a run may start."""

from __future__ import annotations

import trio

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


def test_until_quiet_returns_on_this_machine_within_its_timeout():
    async def main() -> tuple[float, float]:
        return await until_quiet(max_busy_cores=64.0, window_s=0.05, timeout_s=1.0)

    waited, busy = trio.run(main)
    assert 0.0 < waited <= 1.0 and busy >= 0.0
