"""What ``kvmesh bench scale`` reads from a running router replica, as pure functions over the raw text.

CPU and memory come from ``/proc`` for the replica's whole process tree (the router and the children it
started: tokenizer workers and, with ``ingest_process``, its ingest process); ingest progress and
engine health from the replica's ``/metrics``, which costs the replica O(engines), not O(blocks), so it
can be polled while ingesting. ``GET /admin/index`` digests every block and is only read to check
convergence once publishing stopped.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
BATCHES = "kvmesh_event_batches_total"
BLOCKS = "kvmesh_index_blocks"
HEALTHY = "kvmesh_engine_healthy"
REPLAYS = "kvmesh_event_replays_total"
DROPPED = "kvmesh_events_dropped_total"
DEFERRED = "kvmesh_event_ingest_deferred_seconds_total"
BLOCK_OPS = "kvmesh_event_block_ops_total"
LOOP_LAG = "kvmesh_event_loop_lag_seconds_bucket"
INGEST_SECONDS = "kvmesh_ingest_seconds_total"
APPLIED_OPS = ("stored", "removed")


def cpu_seconds(stat: str) -> float:
    """utime + stime of a ``/proc/PID/stat`` line (the command name may hold spaces and parentheses)."""
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_bytes(statm: str) -> int:
    """Resident set size from ``/proc/PID/statm`` (its second field, in pages)."""
    return int(statm.split()[1]) * PAGE_SIZE


def parent_pid(stat: str) -> int:
    """The parent's pid in a ``/proc/PID/stat`` line."""
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process descended from it, now."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):  # a process may end while listed
                children.setdefault(parent_pid((entry / "stat").read_text()), []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, ()))
    return tree


def _summed(pid: int, read) -> float:
    total = 0.0
    for member in process_tree(pid):
        with contextlib.suppress(OSError):  # a child that ended since the listing holds nothing
            total += read(member)
    return total


def process_cpu(pid: int) -> float:
    """CPU seconds of the replica's process tree."""
    return _summed(pid, lambda p: cpu_seconds(Path(f"/proc/{p}/stat").read_text()))


def process_rss(pid: int) -> int:
    """Resident bytes of the replica's process tree."""
    return int(_summed(pid, lambda p: rss_bytes(Path(f"/proc/{p}/statm").read_text())))


THREAD_KINDS = ("zmq", "loop", "others")
"""How ``thread_kind`` sorts a replica's threads: ZeroMQ's I/O threads, each process's main thread (its trio loop),
and the rest (trio's worker threads: tokenizing, file and DNS work)."""


def thread_kind(pid: int, tid: int, comm: str) -> str:
    """A thread's kind (``THREAD_KINDS``) from its process, its id and its name (``/proc/PID/task/TID/comm``)."""
    if comm.startswith("ZMQbg"):
        return "zmq"
    return "loop" if tid == pid else "others"


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of the replica's process tree by kind of thread (``thread_kind``): where the CPU per op that
    its ingest steps do not account for goes. Threads that ended took their seconds with them (a window's growth
    of a kind is then shown as no less than zero)."""
    out = dict.fromkeys(THREAD_KINDS, 0.0)
    for member in process_tree(pid):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{member}/task").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    kind = thread_kind(member, int(task.name), (task / "comm").read_text().strip())
                    out[kind] += cpu_seconds((task / "stat").read_text())
    return out


def run_wait_seconds(schedstats: Sequence[str]) -> float:
    """Seconds the threads waited in the kernel's run queue: a runnable process that got no core.

    ``/proc/PID/task/TID/schedstat`` holds time on a CPU, time waiting for one and timeslices, in ns."""
    return sum(int(text.split()[1]) for text in schedstats if text.strip()) / 1e9


def process_run_wait(pid: int) -> float:
    stats = []
    for member in process_tree(pid):
        with contextlib.suppress(OSError):  # a process or thread may end between listing and reading
            for task in Path(f"/proc/{member}/task").iterdir():
                with contextlib.suppress(OSError):
                    stats.append((task / "schedstat").read_text())
    return run_wait_seconds(stats)


def cpu_pressure_seconds(text: str) -> float:
    """Seconds in which some runnable task on the machine waited for a core (``/proc/pressure/cpu``)."""
    for line in text.splitlines():
        if line.startswith("some "):
            return int(dict(field.split("=") for field in line.split()[1:])["total"]) / 1e6
    raise ValueError("no 'some' line in /proc/pressure/cpu")


def machine_cpu_pressure() -> float:
    """NaN where the kernel does not expose pressure stall information."""
    try:
        return cpu_pressure_seconds(Path("/proc/pressure/cpu").read_text())
    except (OSError, ValueError):
        return math.nan


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """Upper bound of the histogram bucket holding the q-quantile (0..1) of what was observed between two
    scrapes of its cumulative ``le`` buckets; NaN when nothing was."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return math.nan
    wanted = q * counts[-1]
    return next(b for b, c in zip(bounds, counts, strict=True) if c >= wanted)


@dataclass
class EngineGauges:
    """One ``/metrics`` scrape, per engine id: batches applied so far, blocks held, 1 if routable."""

    batches: dict[str, int] = field(default_factory=dict)
    blocks: dict[str, int] = field(default_factory=dict)
    healthy: dict[str, float] = field(default_factory=dict)
    replays: int = 0
    """Replays this replica asked any engine for (a gap in its live stream)."""
    dropped: int = 0
    """Event messages it dropped before the index, for any reason."""
    deferred_s: float = 0.0
    """Seconds its ingest waited for its share of the event loop, summed over engines."""
    block_ops: int = 0
    """Blocks stored and removed in its index so far, over all engines."""
    loop_lag: dict[float, float] = field(default_factory=dict)
    """Its event loop's lag histogram: cumulative count per bucket bound (seconds; +Inf included)."""
    ingest_s: dict[str, float] = field(default_factory=dict)
    """Seconds its ingest took so far, by step (decode, keys, store, rest)."""

    @property
    def unhealthy(self) -> int:
        return sum(1 for v in self.healthy.values() if v < 1)


_FOLLOWED = (BATCHES, BLOCKS, HEALTHY, REPLAYS, DROPPED, DEFERRED, BLOCK_OPS, LOOP_LAG, INGEST_SECONDS)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of the followed metrics' samples. A scrape holds ~40 KB of metrics and the
    generic Prometheus parser took ~65 ms per scrape here, enough to stall the probes' own timing; a
    line filter on the few names followed reads the same values in a fraction of that."""
    out = []
    for line in text.splitlines():
        if not line.startswith(_FOLLOWED):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        if name in _FOLLOWED:
            out.append((name, dict(_LABEL.findall(labels)), float(value)))
    return out


def engine_gauges(text: str) -> EngineGauges:
    """The per-engine samples the benchmark follows; other metrics are ignored."""
    out = EngineGauges()
    targets = {BATCHES: out.batches, BLOCKS: out.blocks, HEALTHY: out.healthy}
    for name, labels, value in _samples(text):
        target = targets.get(name)
        engine = labels.get("engine")
        if target is not None and engine is not None:
            target[engine] = value if target is out.healthy else int(value)
        elif name == REPLAYS and labels.get("outcome") == "requested":
            out.replays += int(value)
        elif name == DROPPED:
            out.dropped += int(value)
        elif name == DEFERRED:
            out.deferred_s += value
        elif name == BLOCK_OPS and labels.get("op") in APPLIED_OPS:
            out.block_ops += int(value)
        elif name == LOOP_LAG and "le" in labels:
            out.loop_lag[float(labels["le"])] = value
        elif name == INGEST_SECONDS and "step" in labels:  # summed over the processes that report (serving, ingest)
            out.ingest_s[labels["step"]] = out.ingest_s.get(labels["step"], 0.0) + value
    return out


def staleness(polled_at: float, applied: dict[str, int], published: dict[str, Sequence[float]]) -> list[float]:
    """Per engine, how old the oldest batch the replica had not applied was when the scrape came back.

    ``applied[e]`` batches applied means seqs ``0..applied-1`` are in the index (every replica starts
    before the first batch and counts replayed batches too); ``published[e][seq]`` is when the publisher
    sent ``seq``. A caught-up engine counts 0. Taking the time the answer arrived bounds the lag from
    above by at most the scrape's round trip.
    """
    out = []
    for engine, times in published.items():
        n = applied.get(engine, 0)
        out.append(polled_at - times[n] if n < len(times) and times[n] <= polled_at else 0.0)
    return out
