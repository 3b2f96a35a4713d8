"""Tables and verdicts from measured rows; pure formatting so the numbers can be checked in tests."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bench.stats import Summary, ratio

BASELINE = "round_robin"


@dataclass
class Row:
    """One policy (or one target URL) on one workload at one concurrency."""

    label: str
    workload: str
    concurrency: int
    summary: Summary
    hit_rate: float
    route_share: list[float] = field(default_factory=list)
    engine_share: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Verdict:
    target: str
    value: float
    bound: str
    passed: bool

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.target}: {_num(self.value, 3)} (needs {self.bound})"


def _num(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def _share(values: list[float]) -> str:
    return "/".join(f"{v * 100:.0f}" for v in values) if values else "-"


def baseline_for(rows: list[Row], row: Row, baseline: str = BASELINE) -> Row | None:
    """The baseline row measured on the same workload and concurrency, if the run had one."""
    for other in rows:
        key = (other.workload, other.concurrency)
        if other.label == baseline and key == (row.workload, row.concurrency):
            return other
    return None


def format_table(rows: list[Row], baseline: str = BASELINE) -> str:
    """Fixed-width table; ratios compare with the baseline row of the same workload and concurrency."""
    head = (
        f"{'workload':>8} {'c':>3} {'policy':<14} {'reqs':>5} {'errs':>4} {'ttft p50':>8} {'ttft p95':>8} "
        f"{'req/s':>7} {'tok/s':>7} {'hit':>6} {'ttft x':>6} {'rps x':>6}  {'routes %':<12} {'engine reqs %'}"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        s = row.summary
        base = baseline_for(rows, row, baseline)
        ttft_x = ratio(s.ttft_p50, base.summary.ttft_p50) if base else math.nan
        rps_x = ratio(s.req_per_s, base.summary.req_per_s) if base else math.nan
        lines.append(
            f"{row.workload:>8} {row.concurrency:>3} {row.label:<14} {s.requests:>5} {s.errors:>4} "
            f"{_num(s.ttft_p50 * 1000):>8} {_num(s.ttft_p95 * 1000):>8} {_num(s.req_per_s):>7} "
            f"{_num(s.out_tok_per_s):>7} {_num(row.hit_rate * 100):>6} {_num(ttft_x, 2):>6} {_num(rps_x, 2):>6}  "
            f"{_share(row.route_share):<12} {_share(row.engine_share)}"
        )
    return "\n".join(lines)


def _find(rows: list[Row], label: str, workload: str, concurrency: int | None = None) -> Row | None:
    for row in rows:
        if (row.label, row.workload) == (label, workload) and concurrency in (None, row.concurrency):
            return row
    return None


def verdicts(rows: list[Row], subject: str = "kv_aware") -> list[Verdict]:
    """The issue's targets that this run has the rows for; a target without its rows is not judged."""
    out = []
    if a := _find(rows, subject, "a"):
        out.append(Verdict(f"(a) {subject} engine hit rate", a.hit_rate, ">= 0.99", a.hit_rate >= 0.99))
    for workload in ("a", "b"):
        mine, base = _find(rows, subject, workload, 1), _find(rows, BASELINE, workload, 1)
        if mine and base:
            x = ratio(mine.summary.ttft_p50, base.summary.ttft_p50)
            out.append(Verdict(f"({workload}) c=1 TTFT p50 vs {BASELINE}", x, "<= 0.55", x <= 0.55))
    mine, base = _find(rows, subject, "b", 32), _find(rows, BASELINE, "b", 32)
    if mine and base:
        x = ratio(mine.summary.req_per_s, base.summary.req_per_s)
        out.append(Verdict(f"(b) c=32 req/s vs {BASELINE}", x, ">= 0.95", x >= 0.95))
    mine, approx = _find(rows, subject, "d"), _find(rows, "approximate", "d")
    if mine and approx:
        gain = mine.hit_rate - approx.hit_rate
        out.append(Verdict("(d) hit rate minus approximate's", gain, "> 0", gain > 0))
    return out
