"""Tables, ratios against R=1, verdicts and the plot of ``kvmesh bench scale`` (pure but for the PNG)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.report import Verdict
from bench.stats import percentile, ratio
from index.ingest_times import STEPS as INGEST_STEPS

CPU_RATIO_MAX = 1.5
RSS_PER_BLOCK_MAX = 200.0
BURST_P99_RATIO_MAX = 2.0
READY_P99_MAX_MS = 100.0
CONVERGE_MAX_S = 5.0
SUSTAINED_OPS = 150_000
"""The rate a replica must keep while serving (with lag, chat and /ready held); a burst above it is an overload,
judged on what the replica does instead: memory within its queues' bound, serving held, converging within
``OVERLOAD_CONVERGE_MAX_S`` once the rate falls back."""
OVERLOAD_CONVERGE_MAX_S = 10.0
RSS_TARGET_REPLICAS = 3
NET_US_PER_OP_MAX = 5.0
"""Ingest's own CPU per block op: 5 us is 200,000 block ops/s on one replica core."""
BURST_LAG_P99_MAX_MS = 100.0
"""How far behind the engines a replica may fall while it serves chat at twice the rate."""
MOONSHOT_OPS_PER_CORE = 1_000_000
KEPT_SHARE = 0.98
"""A replica kept pace with a window's rate when it applied at least this share of what was published in it (and
its lag p99 stayed under ``BURST_LAG_P99_MAX_MS``)."""


@dataclass(frozen=True)
class Latency:
    """Request latencies of one probe window (ms) and how many failed."""

    p50_ms: float = math.nan
    p99_ms: float = math.nan
    count: int = 0
    errors: int = 0

    @classmethod
    def of(cls, seconds: list[float], errors: int = 0) -> Latency:
        return cls(1000 * percentile(seconds, 50), 1000 * percentile(seconds, 99), len(seconds), errors)

    def cell(self) -> str:
        return f"{_num(self.p50_ms)}/{_num(self.p99_ms)}" + (f" ({self.errors} err)" if self.errors else "")


@dataclass(frozen=True)
class Strain:
    """What kept a replica from answering during a probe window.

    ``loop_lag_p99_ms``: its own event loop's lag (``kvmesh_event_loop_lag_seconds``, bucket bound): the
    replica holding its loop. ``run_wait``: share of the window its threads were runnable but got no core;
    ``pressure``: share in which any task on the machine waited for one. Lag far below the latency added
    while run-queue wait and pressure are high says the machine, not the replica, ran out of cores."""

    loop_lag_p99_ms: float = math.nan
    run_wait: float = math.nan
    pressure: float = math.nan

    def cell(self) -> str:
        return f"{_num(self.loop_lag_p99_ms, 0)}/{_num(100 * self.run_wait, 0)}/{_num(100 * self.pressure, 0)}"


@dataclass
class ReplicaResult:
    """One replica of one (replicas, rate) cell."""

    replicas: int
    rate: float
    replica: int
    published_ops_per_s: float
    """What the publisher achieved in the steady window (all engines) ..."""
    burst_ops_per_s: float
    """... and in the burst, meant to be twice the rate."""
    applied_ops_per_s: float
    """Block ops this replica applied in the steady window (below the published rate: it fell behind)."""
    cpu_us_per_op: float
    """CPU over the steady window per block op applied in it."""
    idle_cores: float
    rss_idle: int
    rss_end: int
    live_blocks: int
    rss_after_burst: int
    """RSS once the burst was ingested: what a backlog left behind."""
    lag_p50_ms: float
    lag_p99_ms: float
    burst_lag_p99_ms: float
    equal: bool
    converge_s: float
    """After the burst stopped; inf when the replica never matched the publisher's live set."""
    unhealthy: int
    """Most engines the replica reported not routable in any scrape of the cell."""
    replays: int
    dropped: int
    deferred_s: float
    """Replays asked for, event messages dropped, seconds ingest was deferred (the whole cell)."""
    chat_idle: Latency
    chat_burst: Latency
    ready_idle: Latency
    ready_burst: Latency
    strain_idle: Strain = Strain()
    strain_burst: Strain = Strain()
    ingest_us: dict[str, float] = field(default_factory=dict)
    """Its own ingest time per block op applied in the steady window, by step (``kvmesh_ingest_seconds_total``;
    empty when it reported none, as with its ingest in a process of its own)."""
    burst_applied_ops_per_s: float = math.nan
    """Block ops it applied in the burst, per second of it."""
    thread_us: dict[str, float] = field(default_factory=dict)
    """Its threads' CPU per block op applied in the steady window, by kind (``bench.replica_stats.THREAD_KINDS``)."""
    burst_rss_growth: int = 0
    """RSS as the burst ended less RSS as the steady window ended: what the burst's backlog held."""
    queue_bound_bytes: float = math.nan
    """The most its event queues may hold at the burst's mean message size (``bench.scale.queued_bytes_bound``)."""

    @property
    def net_us_per_op(self) -> float:
        """CPU per op without what the replica burns idle (health and /metrics polls, gossip)."""
        return self.cpu_us_per_op - 1e6 * self.idle_cores / self.applied_ops_per_s

    @property
    def ingest_us_per_op(self) -> float:
        """Its ingest's time on the loop per block op, all steps."""
        return sum(self.ingest_us.values()) if self.ingest_us else math.nan

    @property
    def outside_us_per_op(self) -> float:
        """CPU per op beyond its ingest's steps: the loop's other work (scrapes, polls, the poller's ticks)."""
        return self.cpu_us_per_op - self.ingest_us_per_op

    @property
    def bytes_per_block(self) -> float:
        return (self.rss_end - self.rss_idle) / self.live_blocks if self.live_blocks else math.nan


def _num(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else "inf" if math.isinf(value) else f"{value:.{digits}f}"


Column = tuple[str, int, Callable[["ReplicaResult"], str]]

CELL: list[Column] = [("R", 2, lambda r: str(r.replicas)), ("rate", 7, lambda r: f"{r.rate:.0f}"),
                      ("rep", 3, lambda r: str(r.replica))]
INGEST: list[Column] = [
    ("pub ops/s", 9, lambda r: f"{r.published_ops_per_s:.0f}"),
    ("burst ops/s", 11, lambda r: f"{r.burst_ops_per_s:.0f}"),
    ("applied/s", 9, lambda r: f"{r.applied_ops_per_s:.0f}"),
    ("cpu us/op", 9, lambda r: _num(r.cpu_us_per_op, 2)),
    ("net us/op", 9, lambda r: _num(r.net_us_per_op, 2)),
    ("idle %cpu", 9, lambda r: _num(100 * r.idle_cores)),
    ("RSS MB", 7, lambda r: _num(r.rss_end / 1e6)),
    ("B/block", 7, lambda r: _num(r.bytes_per_block)),
    ("live", 8, lambda r: str(r.live_blocks)),
    ("lag p50", 7, lambda r: _num(r.lag_p50_ms)),
    ("lag p99", 7, lambda r: _num(r.lag_p99_ms)),
    ("burst p99", 9, lambda r: _num(r.burst_lag_p99_ms)),
]
CONVERGENCE: list[Column] = [
    ("RSS MB", 7, lambda r: _num(r.rss_after_burst / 1e6)),
    ("equal", 5, lambda r: "yes" if r.equal else "NO"),
    ("conv s", 6, lambda r: _num(r.converge_s, 2)),
    ("unhealthy", 9, lambda r: str(r.unhealthy)),
    ("replays", 7, lambda r: str(r.replays)),
    ("drops", 5, lambda r: str(r.dropped)),
    ("defer s", 7, lambda r: _num(r.deferred_s, 2)),
    ("burst +MB", 9, lambda r: _num(r.burst_rss_growth / 1e6)),
    ("queues MB", 9, lambda r: _num(r.queue_bound_bytes / 1e6)),
]
SPLIT: list[Column] = [
    *((step, 7, lambda r, step=step: _num(r.ingest_us.get(step, math.nan), 2)) for step in INGEST_STEPS),
    ("ingest", 7, lambda r: _num(r.ingest_us_per_op, 2)),
    ("outside", 7, lambda r: _num(r.outside_us_per_op, 2)),
    ("zmq", 7, lambda r: _num(r.thread_us.get("zmq", math.nan), 2)),
    ("others", 7, lambda r: _num(r.thread_us.get("others", math.nan), 2)),
    ("cpu", 7, lambda r: _num(r.cpu_us_per_op, 2)),
]
SERVING: list[Column] = [
    ("chat idle p50/p99", 20, lambda r: r.chat_idle.cell()),
    ("chat burst p50/p99", 20, lambda r: r.chat_burst.cell()),
    ("/ready idle p50/p99", 20, lambda r: r.ready_idle.cell()),
    ("/ready burst p50/p99", 20, lambda r: r.ready_burst.cell()),
    ("chats idle/burst", 16, lambda r: f"{r.chat_idle.count}/{r.chat_burst.count}"),
    ("lag/wait%/psi% idle", 19, lambda r: r.strain_idle.cell()),
    ("lag/wait%/psi% burst", 20, lambda r: r.strain_burst.cell()),
]


def _table(title: str, columns: list[Column], results: list[ReplicaResult]) -> list[str]:
    head = " ".join(f"{name:>{width}}" for name, width, _ in columns)
    rows = [" ".join(f"{cell(r):>{width}}" for _, width, cell in columns) for r in results]
    return [title, head, "-" * len(head), *rows, ""]


def format_tables(results: list[ReplicaResult]) -> str:
    return "\n".join([
        *_table("ingest (steady window; net us/op: without idle CPU; lag in ms)", CELL + INGEST, results),
        *_table("where each block op's time goes in place (steady window, us per op applied: the replica's own "
                "ingest times by step; outside: its CPU per op less them, of which zmq: ZeroMQ's I/O threads, others: "
                "threads besides those and the loop's)", CELL + SPLIT, results),
        *_table("after the burst (conv s: until equal to the publisher; counts over the cell; burst +MB: RSS growth "
                "over the burst; queues MB: what its event queues may hold at the burst's message size)",
                CELL + CONVERGENCE, results),
        *_table("serving through each replica (ms; burst = 2x the rate; lag: the replica's event-loop lag p99, "
                "ms; wait%: share of the window its threads waited for a core; psi%: share in which any task "
                "on the machine did)", CELL + SERVING, results),
    ]).rstrip()


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def by_cell(results: list[ReplicaResult]) -> dict[tuple[float, int], list[ReplicaResult]]:
    cells: dict[tuple[float, int], list[ReplicaResult]] = defaultdict(list)
    for r in results:
        cells[(r.rate, r.replicas)].append(r)
    return dict(sorted(cells.items()))


def format_ratios(results: list[ReplicaResult]) -> str:
    """Per rate and R, the mean per-replica CPU per op and RSS per block over the R=1 figures of the run."""
    cells = by_cell(results)
    lines = ["ratios against R=1 (mean over replicas, same run)"]
    for (rate, replicas), rows in cells.items():
        base = cells.get((rate, 1))
        if base is None or replicas == 1:
            continue
        cpu = ratio(_mean([r.cpu_us_per_op for r in rows]), _mean([r.cpu_us_per_op for r in base]))
        rss = ratio(_mean([r.bytes_per_block for r in rows]), _mean([r.bytes_per_block for r in base]))
        lines.append(f"  rate {rate:.0f} R={replicas}: cpu/op {_num(cpu, 2)}x  RSS/block {_num(rss, 2)}x")
    return "\n".join(lines)


def verdicts(results: list[ReplicaResult]) -> list[Verdict]:
    """The targets, each judged on the worst replica of the cells it applies to."""
    out = []
    cells = by_cell(results)
    for (rate, replicas), rows in cells.items():
        base = cells.get((rate, 1))
        if replicas in (2, 3) and base:
            worst = max(r.cpu_us_per_op for r in rows)
            value = ratio(worst, _mean([r.cpu_us_per_op for r in base]))
            out.append(Verdict(f"CPU per block op, R={replicas} vs R=1 at {rate:.0f} ops/s (worst replica, x)",
                               value, f"<= {CPU_RATIO_MAX}", not math.isnan(value) and value <= CPU_RATIO_MAX))
    largest = max((r.replicas for r in results), default=0)
    judged_r = RSS_TARGET_REPLICAS if any(r.replicas == RSS_TARGET_REPLICAS for r in results) else largest
    for (rate, replicas), rows in cells.items():
        if replicas != judged_r:
            continue
        worst = max(rows, key=lambda r: _num_or_inf(r.bytes_per_block))
        value = worst.bytes_per_block
        out.append(Verdict(f"RSS per live block at R={judged_r}, {rate:.0f} ops/s (B)", value,
                           f"<= {RSS_PER_BLOCK_MAX:.0f}", not math.isnan(value) and value <= RSS_PER_BLOCK_MAX,
                           f"measured at {worst.live_blocks:,} live blocks, lag p99 {_num(worst.lag_p99_ms, 0)} ms"))
    for rate, rows in _largest_cells(results).items():
        worst = max(rows, key=lambda r: _num_or_inf(r.net_us_per_op))
        value = worst.net_us_per_op
        out.append(Verdict(f"net CPU per block op at R={worst.replicas}, {rate:.0f} ops/s (us; "
                           f"{NET_US_PER_OP_MAX:.0f} us is {1e6 / NET_US_PER_OP_MAX:,.0f} ops/s per core)", value,
                           f"<= {NET_US_PER_OP_MAX:.1f}", not math.isnan(value) and value <= NET_US_PER_OP_MAX,
                           f"{1e6 / value:,.0f} block ops/s per replica core" if value > 0 else ""))
    if results:
        out += _burst_verdicts(results)
    return out


def _largest_cells(results: list[ReplicaResult]) -> dict[float, list[ReplicaResult]]:
    """Per rate, the replicas of the cell with the most replicas: what one core of a full mesh pays."""
    largest = max((r.replicas for r in results), default=0)
    cells: dict[float, list[ReplicaResult]] = defaultdict(list)
    for r in results:
        if r.replicas == largest:
            cells[r.rate].append(r)
    return cells


def _num_or_inf(value: float) -> float:
    return math.inf if math.isnan(value) else value


def _burst_verdicts(results: list[ReplicaResult]) -> list[Verdict]:
    def where(r: ReplicaResult) -> str:
        strain = r.strain_burst
        return (f"worst: R={r.replicas} rate {r.rate:.0f} replica {r.replica} (in the burst its loop lag p99 "
                f"{_num(strain.loop_lag_p99_ms, 0)} ms, it waited for a core {_num(100 * strain.run_wait, 0)}% of "
                f"the time, machine CPU pressure {_num(100 * strain.pressure, 0)}%)")

    chat = max(results, key=_burst_p99_ratio)
    ready = max(results, key=lambda r: _num_or_inf(r.ready_burst.p99_ms) if not r.ready_burst.errors else math.inf)
    sick = max(results, key=lambda r: r.unhealthy)
    ready_p99 = ready.ready_burst.p99_ms if not ready.ready_burst.errors else math.inf
    out = [
        Verdict("chat p99 during the 2x burst / idle p99 (x)", _burst_p99_ratio(chat), f"<= {BURST_P99_RATIO_MAX}",
                _burst_p99_ratio(chat) <= BURST_P99_RATIO_MAX, where(chat)),
        Verdict("/ready p99 during the 2x burst (ms)", ready_p99, f"< {READY_P99_MAX_MS:.0f}",
                ready_p99 < READY_P99_MAX_MS, where(ready)),
        Verdict("engines marked unhealthy by a replica", sick.unhealthy, "0", sick.unhealthy == 0, where(sick)),
    ]
    kept = [r for r in results if not overloaded(r)]
    if kept:
        behind = max(kept, key=lambda r: _num_or_inf(r.burst_lag_p99_ms))
        slow = max(kept, key=lambda r: r.converge_s)
        out += [
            Verdict(f"replication lag p99 during the 2x burst, up to {SUSTAINED_OPS:,} ops/s (ms)",
                    behind.burst_lag_p99_ms, f"< {BURST_LAG_P99_MAX_MS:.0f}",
                    behind.burst_lag_p99_ms < BURST_LAG_P99_MAX_MS, where(behind)),
            Verdict(f"convergence on the publisher's live set after the burst, up to {SUSTAINED_OPS:,} ops/s (s)",
                    slow.converge_s, f"<= {CONVERGE_MAX_S:.0f}",
                    slow.converge_s <= CONVERGE_MAX_S and all(r.equal for r in kept), where(slow)),
        ]
    over = [r for r in results if overloaded(r)]
    if over:
        fullest = max(over, key=lambda r: _num_or_inf(queue_share(r)))
        slow = max(over, key=lambda r: r.converge_s)
        out += [
            Verdict(f"RSS growth in an overload burst (over {SUSTAINED_OPS:,} ops/s) / its event queues' bound (x)",
                    queue_share(fullest), "<= 1", queue_share(fullest) <= 1.0,
                    f"R={fullest.replicas} rate {fullest.rate:.0f} replica {fullest.replica}: "
                    f"{fullest.burst_rss_growth / 1e6:.0f} MB against {fullest.queue_bound_bytes / 1e6:.0f} MB"),
            Verdict("convergence on the publisher's live set after an overload burst (s)", slow.converge_s,
                    f"<= {OVERLOAD_CONVERGE_MAX_S:.0f}",
                    slow.converge_s <= OVERLOAD_CONVERGE_MAX_S and all(r.equal for r in over), where(slow)),
        ]
    return out


def overloaded(result: ReplicaResult) -> bool:
    """Whether its burst (twice the rate) was above the rate a replica must keep while serving."""
    return 2 * result.rate > SUSTAINED_OPS


def queue_share(result: ReplicaResult) -> float:
    """Its RSS growth in the burst over what its event queues may hold (NaN without a bound)."""
    if not result.queue_bound_bytes > 0:
        return math.nan
    return result.burst_rss_growth / result.queue_bound_bytes


def _kept(published: float, applied: float, lag_p99_ms: float) -> bool:
    return applied >= KEPT_SHARE * published and lag_p99_ms < BURST_LAG_P99_MAX_MS


def _burst_p99_ratio(r: ReplicaResult) -> float:
    value = ratio(r.chat_burst.p99_ms, r.chat_idle.p99_ms)
    return math.inf if math.isnan(value) or r.chat_burst.errors else value


def kept_rates(results: list[ReplicaResult]) -> list[str]:
    """Per replica count, the highest rate every replica kept pace with: in the steady windows (scrapes only) and
    in the bursts, which serve chat and ``/ready`` meanwhile (there its chat p99 must also stay within
    ``BURST_P99_RATIO_MAX`` of idle). A window is kept when each replica applied ``KEPT_SHARE`` of what was
    published in it with lag p99 under ``BURST_LAG_P99_MAX_MS``."""
    lines = []
    for replicas in sorted({r.replicas for r in results}):
        steady: list[float] = []
        serving: list[float] = []
        missed: list[str] = []
        for (_, count), rows in by_cell(results).items():
            if count != replicas:
                continue
            published, burst = _mean([r.published_ops_per_s for r in rows]), _mean([r.burst_ops_per_s for r in rows])
            if all(_kept(r.published_ops_per_s, r.applied_ops_per_s, r.lag_p99_ms) for r in rows):
                steady.append(published)
            if all(_kept(r.burst_ops_per_s, r.burst_applied_ops_per_s, r.burst_lag_p99_ms)
                   and _burst_p99_ratio(r) <= BURST_P99_RATIO_MAX for r in rows):
                serving.append(burst)
            else:
                worst = min(rows, key=lambda r: ratio(r.burst_applied_ops_per_s, r.burst_ops_per_s))
                missed.append(f"{burst:,.0f} (applied {_num(100 * ratio(worst.burst_applied_ops_per_s, burst), 0)}%, "
                              f"lag p99 {_num(worst.burst_lag_p99_ms, 0)} ms, chat p99 "
                              f"{_num(_burst_p99_ratio(worst), 2)}x idle)")
        best = f"{max(serving):,.0f} block ops/s" if serving else "none of the rates measured"
        lines.append(f"highest rate kept at R={replicas}: steady (scrapes only) "
                     f"{f'{max(steady):,.0f}' if steady else 'none'}; while serving chat {best}"
                     + (f"; not kept while serving: {', '.join(missed)}" if missed else ""))
    return lines


def moonshot(results: list[ReplicaResult]) -> str:
    """The stretch goal, printed but not judged: block ops per replica core (net of idle), at the most replicas."""
    largest = max(r.replicas for r in results)
    cost = _mean([r.net_us_per_op for r in results if r.replicas == largest])
    per_core = 1e6 / cost if cost and not math.isnan(cost) else math.nan
    return (f"moonshot (not judged): {_num(per_core, 0)} block ops/s per replica core at R={largest}, net of idle "
            f"(goal {MOONSHOT_OPS_PER_CORE:,})")


def plot(results: list[ReplicaResult], path: Path) -> Path | None:
    """CPU us per op and RSS B per block against R, one line per rate, and where each op's time goes in place
    per cell (stacked: ingest's steps, then the rest of the replica's CPU); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cells = by_cell(results)
    fig, (cpu_ax, rss_ax, split_ax) = plt.subplots(1, 3, figsize=(15, 4))
    for rate in sorted({rate for rate, _ in cells}):
        counts = sorted(r for q, r in cells if q == rate)
        cpu_ax.plot(counts, [_mean([x.cpu_us_per_op for x in cells[(rate, r)]]) for r in counts], marker="o",
                    label=f"{rate:.0f} ops/s")
        rss_ax.plot(counts, [_mean([x.bytes_per_block for x in cells[(rate, r)]]) for r in counts], marker="o",
                    label=f"{rate:.0f} ops/s")
    for ax, title in ((cpu_ax, "CPU per block op per replica (us)"), (rss_ax, "RSS per live block (bytes)")):
        ax.set_title(title)
        ax.set_xlabel("router replicas (R)")
        ax.set_xticks(sorted({r for _, r in cells}))
        ax.set_ylim(bottom=0)
        ax.legend()
    _plot_split(split_ax, cells)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _plot_split(ax: Any, cells: dict[tuple[float, int], list[ReplicaResult]]) -> None:
    """One stacked bar per (rate, R): the mean replica's ingest steps and its CPU outside them, us per op."""
    labels = [f"{rate / 1000:.0f}k R={replicas}" for rate, replicas in cells]
    bottom = [0.0] * len(cells)
    for part in (*INGEST_STEPS, "outside"):
        heights = [_mean([r.outside_us_per_op if part == "outside" else r.ingest_us.get(part, math.nan)
                          for r in rows]) for rows in cells.values()]
        heights = [0.0 if math.isnan(h) else max(0.0, h) for h in heights]
        ax.bar(labels, heights, bottom=bottom, label=part)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_title("where each block op's time goes in place (us)")
    ax.set_xlabel("rate and replicas")
    ax.legend()
