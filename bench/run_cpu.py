"""What a measured run cost in CPU: its routers' per request, and the whole machine's.

The suite runs every entry's engines, routers and clients on the same cores, so where the machine is near
busy, the TTFT columns compare the entries' CPU per request more than their routing. Printing both beside the
TTFT says which of the two a row measures.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from bench.replica_stats import process_cpu
from bench.settle import busy_cores, machine_cpu_times


@dataclass(frozen=True)
class CpuMark:
    """CPU counters at one moment: each router pid's process tree (seconds) and the machine's jiffies."""

    routers: dict[int, float]
    machine: tuple[int, int] | None


def mark(pids: Collection[int]) -> CpuMark:
    """The counters now; a router that has ended is left out."""
    return CpuMark({pid: process_cpu(pid) for pid in pids if Path(f"/proc/{pid}").exists()}, machine_cpu_times())


def router_cpu_per_request(before: CpuMark, after: CpuMark, requests: int) -> float:
    """Router CPU seconds per request between two marks; NaN when no router was marked or one ended between them
    (a killed replica takes its counters with it)."""
    if not before.routers or requests <= 0 or set(after.routers) != set(before.routers):
        return math.nan
    return sum(after.routers[pid] - before.routers[pid] for pid in before.routers) / requests


def machine_busy_cores(before: CpuMark, after: CpuMark) -> float:
    """Cores' worth of the machine busy between two marks; NaN without ``/proc/stat``."""
    if before.machine is None or after.machine is None:
        return math.nan
    return busy_cores(before.machine, after.machine, os.cpu_count() or 1)
