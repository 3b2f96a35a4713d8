"""Waiting for the machine to go quiet before a measured run.

A routing suite starts every entry's simulated fleet and routers at once and then measures them one after
the other. Starting a router costs seconds of CPU (imports, loading the tokenizer, its tokenizer worker
processes), and on a 2-core machine a run measured while others still start pays for their start-up in its
time to first token: seed 1's shape #7 (one stream, 15 engines), measured first, gave kv_aware a TTFT 19-27 ms
over smg's per request (median of pairs) at the same hit rate, against 5.5 ms with three entries and 3.8-7.4 ms
once the runs waited. So a run starts once the machine's busy CPU, over short windows, is under a bound or has
stopped falling (the idle fleets' and routers' steady background, which every entry shares), or a timeout passed."""

from __future__ import annotations

import os
from collections.abc import Callable

import trio

QUIET_BUSY_CORES = 0.5
"""Cores' worth of CPU that may be busy (the idle fleets' and routers' own background) for the machine to count as
quiet."""
QUIET_WINDOW_S = 0.5
QUIET_TIMEOUT_S = 15.0
STEADY_WINDOWS = 3
STEADY_SPREAD_CORES = 0.15
"""Busy CPU that moved by at most this over the last ``STEADY_WINDOWS`` windows is a steady background, not a start."""


def quiet(busy_history: list[float], max_busy_cores: float = QUIET_BUSY_CORES) -> bool:
    """Whether the windows so far (busy cores, oldest first) show a machine done starting things."""
    if not busy_history:
        return False
    if busy_history[-1] <= max_busy_cores:
        return True
    last = busy_history[-STEADY_WINDOWS:]
    return len(last) == STEADY_WINDOWS and max(last) - min(last) <= STEADY_SPREAD_CORES


def cpu_times(stat_text: str) -> tuple[int, int]:
    """(busy, total) jiffies of the machine from ``/proc/stat``'s first line (iowait counts as idle)."""
    fields = [int(x) for x in stat_text.split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return total - idle, total


def busy_cores(before: tuple[int, int], after: tuple[int, int], cores: int) -> float:
    """Cores' worth of CPU busy between two ``cpu_times`` samples."""
    total = after[1] - before[1]
    return cores * (after[0] - before[0]) / total if total > 0 else 0.0


def machine_cpu_times() -> tuple[int, int] | None:
    """The machine's ``cpu_times`` now; None where ``/proc/stat`` cannot be read."""
    try:
        with open("/proc/stat") as f:
            return cpu_times(f.read())
    except (OSError, ValueError, IndexError):
        return None


async def until_quiet(max_busy_cores: float = QUIET_BUSY_CORES, window_s: float = QUIET_WINDOW_S,
                      timeout_s: float = QUIET_TIMEOUT_S,
                      sample: Callable[[], tuple[int, int] | None] = machine_cpu_times) -> tuple[float, float]:
    """Wait until the windows' busy CPU is ``quiet`` (at most ``timeout_s``); returns the seconds waited and the
    last window's busy cores (0 where ``/proc/stat`` cannot be read: nothing is waited for). ``sample`` gives
    ``cpu_times`` (the machine's, by default)."""
    cores = os.cpu_count() or 1
    waited = 0.0
    busy = 0.0
    history: list[float] = []
    while waited < timeout_s:
        before = sample()
        if before is None:
            break
        await trio.sleep(window_s)
        waited += window_s
        after = sample()
        if after is None:
            break
        busy = busy_cores(before, after, cores)
        history.append(busy)
        if quiet(history, max_busy_cores):
            break
    return waited, busy
