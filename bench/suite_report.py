"""What ``kvmesh bench routing --suite`` prints and judges: per shape and over the suite, each policy's hit rate
as a fraction of the offline bound of its own trace, and its TTFT p50/p90/p99 against round robin's on the same
shape; the suite's targets as verdicts; a PNG of the fractions. Pure arithmetic and formatting, so it is tested.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from bench.report import BASELINE, Row, Verdict
from bench.stats import ratio
from bench.suite_shapes import Shape

SUBJECT = "kv_aware"
PEER = "smg:cache_aware"
MEAN_FRACTION = 0.95
MIN_FRACTION = 0.85
P99_SLACK = 1.1
MESH_POINTS = 0.02


@dataclass
class ShapeRun:
    shape: Shape
    time_scale: float
    num_blocks: int
    rows: list[Row]

    def row(self, label: str) -> Row | None:
        return next((r for r in self.rows if r.label == label), None)


def fraction(row: Row) -> float:
    """Hit rate over the bound's for the same trace; NaN without a bound (or with a bound of zero)."""
    return ratio(row.hit_rate, row.bound_hit_rate)


def ttft_ratios(row: Row, base: Row | None) -> tuple[float, float, float]:
    """TTFT p50, p90 and p99 over the baseline's on the same shape."""
    if base is None:
        return math.nan, math.nan, math.nan
    return (ratio(row.summary.ttft_p50, base.summary.ttft_p50), ratio(row.ttft_p90, base.ttft_p90),
            ratio(row.ttft_p99, base.ttft_p99))


def _mean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.fmean(kept) if kept else math.nan


def _num(value: float, digits: int = 2) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def _ms(value: float, digits: int = 0) -> str:
    return "-" if math.isnan(value) else f"{value * 1000:.{digits}f}"


def labels(runs: list[ShapeRun]) -> list[str]:
    return list(dict.fromkeys(r.label for run in runs for r in run.rows))


def engines_used(row: Row) -> int:
    """Engines that served at least one of the run's requests (by their own counters)."""
    return sum(1 for share in row.engine_share if share > 0)


def busiest_share(row: Row) -> float:
    """The largest share of the run's requests one engine served (NaN without the engines' counters)."""
    return max(row.engine_share) if row.engine_share else math.nan


def format_shapes(runs: list[ShapeRun]) -> str:
    """One block per shape: each entry's hit, bound, fraction, hit of the run's second half (``hit 2nd``: where
    the survivors route in a run that kills a replica), TTFT p50/p90/p99 (ms, and x round robin), its router's
    mean decision time (tokenize and score, ms), the mean time its requests spent outside the engines before
    their first token (``out ms``: client TTFT minus the engines' own), how many engines served any, the
    busiest one's share of the requests, the router's CPU per request (``cpu ms``, streaming included) and the
    cores' worth of the machine busy over the run (``busy``)."""
    head = (f"  {'policy':<18} {'reqs':>4} {'errs':>4} {'hit':>6} {'bound':>6} {'frac':>5} {'hit 2nd':>7} "
            f"{'p50':>6} {'p90':>6} "
            f"{'p99':>6} {'p50 x':>6} {'p90 x':>6} {'p99 x':>6} {'dec ms':>6} {'out ms':>6} {'eng':>3} {'top':>4} "
            f"{'cpu ms':>6} {'busy':>4}")
    lines = []
    for run in runs:
        lines += [f"{run.shape.label} (time scale {run.time_scale}, {run.num_blocks} blocks/engine)", head]
        base = run.row(BASELINE)
        for row in run.rows:
            x50, x90, x99 = ttft_ratios(row, base)
            lines.append(
                f"  {row.label:<18} {row.summary.requests:>4} {row.summary.errors:>4} {_num(row.hit_rate, 3):>6} "
                f"{_num(row.bound_hit_rate, 3):>6} {_num(fraction(row)):>5} {_num(row.late_hit_rate, 3):>7} "
                f"{_ms(row.summary.ttft_p50):>6} "
                f"{_ms(row.ttft_p90):>6} {_ms(row.ttft_p99):>6} {_num(x50):>6} {_num(x90):>6} {_num(x99):>6} "
                f"{_num(row.decision_ms, 1):>6} {_ms(row.outside_engines_s, 1):>6} {engines_used(row):>3} "
                f"{_num(busiest_share(row)):>4} {_ms(row.router_cpu_s, 1):>6} {_num(row.busy_cores, 1):>4}"
            )
    return "\n".join(lines)


@dataclass(frozen=True)
class Overall:
    """One entry over the suite: means over the shapes it ran on."""

    label: str
    shapes: int
    mean_fraction: float
    min_fraction: float
    mean_hit: float
    ttft_x: tuple[float, float, float]
    """Mean over shapes of TTFT p50/p90/p99 over round robin's."""
    p90_worse: int
    """Shapes where its TTFT p90 is worse than round robin's."""
    p99_worse: int
    """Shapes where its TTFT p99 is worse than ``P99_SLACK`` times round robin's."""
    out_s: float = math.nan
    """Mean over shapes of the time its requests spent outside the engines before their first token."""
    router_cpu_s: float = math.nan
    """Mean over shapes of its routers' CPU per request."""


def overall(runs: list[ShapeRun], label: str, base: str = BASELINE) -> Overall:
    """``label``'s means over the shapes it ran on, its TTFTs against ``base``'s on each shape."""
    mine = [(run.row(label), run.row(base)) for run in runs]
    pairs = [(r, b) for r, b in mine if r is not None]
    fractions = [fraction(r) for r, _ in pairs]
    xs = [ttft_ratios(r, b) for r, b in pairs]
    kept = [f for f in fractions if not math.isnan(f)]
    return Overall(
        label, len(pairs), _mean(fractions), min(kept) if kept else math.nan, _mean([r.hit_rate for r, _ in pairs]),
        (_mean([x[0] for x in xs]), _mean([x[1] for x in xs]), _mean([x[2] for x in xs])),
        sum(1 for x in xs if x[1] > 1.0), sum(1 for x in xs if x[2] > P99_SLACK),
        _mean([r.outside_engines_s for r, _ in pairs]), _mean([r.router_cpu_s for r, _ in pairs]),
    )


def format_overall(runs: list[ShapeRun]) -> str:
    head = (f"{'policy':<18} {'shapes':>6} {'frac mean':>9} {'frac min':>8} {'hit mean':>8} {'p50 x':>6} "
            f"{'p90 x':>6} {'p99 x':>6} {'p90>rr':>6} {'p99>1.1rr':>9} {'out ms':>6} {'cpu ms':>6}")
    lines = [head, "-" * len(head)]
    for label in labels(runs):
        o = overall(runs, label)
        lines.append(
            f"{o.label:<18} {o.shapes:>6} {_num(o.mean_fraction, 3):>9} {_num(o.min_fraction, 3):>8} "
            f"{_num(o.mean_hit, 3):>8} {_num(o.ttft_x[0]):>6} {_num(o.ttft_x[1]):>6} {_num(o.ttft_x[2]):>6} "
            f"{o.p90_worse:>6} {o.p99_worse:>9} {_ms(o.out_s, 1):>6} {_ms(o.router_cpu_s, 1):>6}"
        )
    return "\n".join(lines)


def first_runs(runs: list[ShapeRun]) -> dict[str, str]:
    """Each rerun entry's label (``round_robin #2``) and the label of its policy's first entry, when both ran."""
    names = labels(runs)
    out = {}
    for label in names:
        first, mark, number = label.rpartition(" #")
        if mark and number.isdigit() and first in names:
            out[label] = first
    return out


def format_reruns(runs: list[ShapeRun]) -> str:
    """A policy run twice on each shape, its second run judged against its first as the targets judge kv_aware
    against round robin and against one router: how far a row moves between two runs of the same code is the
    floor under which no difference between policies means anything (empty without reruns)."""
    pairs = first_runs(runs)
    if not pairs:
        return ""
    head = (f"{'rerun':<18} {'of':<14} {'frac diff':>9} {'hit diff':>8} {'p50 x':>6} {'p90 x':>6} {'p99 x':>6} "
            f"{'p90>1st':>7} {'p99>1.1x':>8}")
    lines = ["each rerun against its policy's first run on the same shapes (diffs: rerun minus first)", head,
             "-" * len(head)]
    for label, first in pairs.items():
        again, once = overall(runs, label, base=first), overall(runs, first)
        lines.append(
            f"{label:<18} {first:<14} {_num(again.mean_fraction - once.mean_fraction, 3):>9} "
            f"{_num(again.mean_hit - once.mean_hit, 3):>8} {_num(again.ttft_x[0]):>6} {_num(again.ttft_x[1]):>6} "
            f"{_num(again.ttft_x[2]):>6} {again.p90_worse:>7} {again.p99_worse:>8}"
        )
    return "\n".join(lines)


def verdicts(runs: list[ShapeRun], subject: str = SUBJECT, peer: str = PEER) -> list[Verdict]:
    """The targets one suite is judged by (the three-seed condition is three suites' verdicts)."""
    mine = overall(runs, subject)
    if mine.shapes == 0:
        return []
    out = [
        Verdict(f"{subject} mean fraction of bound", mine.mean_fraction, f">= {MEAN_FRACTION}",
                mine.mean_fraction >= MEAN_FRACTION),
        Verdict(f"{subject} lowest fraction of bound", mine.min_fraction, f">= {MIN_FRACTION}",
                mine.min_fraction >= MIN_FRACTION),
    ]
    if overall(runs, BASELINE).shapes:  # without round robin in the run there is no tail to judge
        out += [
            Verdict(f"{subject} shapes with TTFT p90 worse than {BASELINE}", mine.p90_worse, "0", mine.p90_worse == 0),
            Verdict(f"{subject} shapes with TTFT p99 over {P99_SLACK}x {BASELINE}", mine.p99_worse, "0",
                    mine.p99_worse == 0),
        ]
    other = overall(runs, peer)
    if other.shapes:
        out.append(Verdict(f"{subject} mean hit minus {peer}'s", mine.mean_hit - other.mean_hit, "> 0",
                           mine.mean_hit > other.mean_hit))
        for i, name in ((0, "p50"), (1, "p90")):
            gap = mine.ttft_x[i] - other.ttft_x[i]
            out.append(Verdict(f"{subject} mean TTFT {name} x {BASELINE} minus {peer}'s", gap, "< 0", gap < 0))
    for label in labels(runs):
        if label.startswith(f"{subject} x"):
            meshed = overall(runs, label)
            points = mine.mean_fraction - meshed.mean_fraction
            out.append(Verdict(f"{label} mean fraction of bound below one router's", points, f"<= {MESH_POINTS}",
                               points <= MESH_POINTS))
    return out


def plot(runs: list[ShapeRun], path: Path) -> None:
    """Grouped bars: fraction of bound per shape, one bar per entry, with the targets as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = labels(runs)
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(runs) + 2), 4))
    for k, label in enumerate(names):
        values = [fraction(r) if (r := run.row(label)) else math.nan for run in runs]
        ax.bar([i + k * width for i in range(len(runs))], values, width, label=label)
    ax.axhline(MEAN_FRACTION, color="black", linewidth=0.8, linestyle="--")
    ax.axhline(MIN_FRACTION, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(runs))], [f"#{run.shape.index}" for run in runs])
    ax.set_ylabel("hit rate / offline bound")
    ax.set_xlabel("shape")
    ax.legend(fontsize="small", ncols=min(5, len(names)))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
