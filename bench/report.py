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
    routers: int = 1
    """Router replicas that shared the requests (client-side round robin)."""
    ttft_floor: float = math.nan
    """Median perfect-cache TTFT of the same prompts under the simulated engines' cost model."""
    ttft_p90: float = math.nan
    ttft_p99: float = math.nan
    bound_hit_rate: float = math.nan
    """The offline planner's fleet hit rate for the same trace (bench/offline_bound.py), when computed."""
    bound_ttft_p50: float = math.nan
    run: int = 1
    """Which of the consecutive runs on the same engines and routers (1: fresh engines)."""
    decision_ms: float = math.nan
    """The router's mean tokenize-and-score time per request (kvmesh routers only)."""
    outside_engines_s: float = math.nan
    """The client's mean TTFT minus the engines' own (``fleet_engine_ttft``): the time a request spends outside
    the engines before its first token (the router's decision and relay, and the network)."""
    late_hit_rate: float = math.nan
    """Token hit rate, by the engines' usage reports, of the second half of the requests sent (where a killed
    replica's survivors route, in a run that kills one)."""
    router_cpu_s: float = math.nan
    """CPU seconds per request of the row's router processes (and their children) over the measured run, when
    their pids are known: what each request cost the router, streaming included."""
    busy_cores: float = math.nan
    """Cores' worth of the machine's CPU busy over the measured run (everything on it: engines, routers, clients):
    near the core count, the run measures who needs the least CPU more than where requests went."""

    @property
    def cell(self) -> tuple[str, int, int, int]:
        """Rows of one cell saw the same workload at the same concurrency through as many routers, as the
        same run on their engines."""
        return (self.workload, self.concurrency, self.routers, self.run)


@dataclass(frozen=True)
class Verdict:
    target: str
    value: float
    bound: str
    passed: bool
    note: str = ""

    def line(self) -> str:
        text = f"{'PASS' if self.passed else 'FAIL'}  {self.target}: {_num(self.value, 3)} (needs {self.bound})"
        return f"{text}; {self.note}" if self.note else text


def _num(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def _share(values: list[float]) -> str:
    return "/".join(f"{v * 100:.0f}" for v in values) if values else "-"


def baseline_for(rows: list[Row], row: Row, baseline: str = BASELINE) -> Row | None:
    """The baseline row measured in the same cell, if the run had one."""
    for other in rows:
        if other.label == baseline and other.cell == row.cell:
            return other
    return None


def format_table(rows: list[Row], baseline: str = BASELINE) -> str:
    """Fixed-width table; ratios compare with the baseline row of the same cell.

    ``tok hit`` is the engines' token-level prefix-cache hit rate (hits over queried prompt tokens);
    ``req hit`` the share of requests whose shared prefix the engine served from cache (bench.prefix).
    """
    head = (
        f"{'workload':>8} {'c':>3} {'rtr':>3} {'policy':<14} {'reqs':>5} {'errs':>4} {'ttft p50':>8} "
        f"{'ttft p95':>8} {'req/s':>7} {'tok/s':>7} {'tok hit':>7} {'req hit':>7} {'ttft x':>6} {'rps x':>6}  "
        f"{'routes %':<12} {'engine reqs %'}"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        s = row.summary
        base = baseline_for(rows, row, baseline)
        ttft_x = ratio(s.ttft_p50, base.summary.ttft_p50) if base else math.nan
        rps_x = ratio(s.req_per_s, base.summary.req_per_s) if base else math.nan
        lines.append(
            f"{row.workload:>8} {row.concurrency:>3} {row.routers:>3} {row.label:<14} {s.requests:>5} "
            f"{s.errors:>4} {_num(s.ttft_p50 * 1000):>8} {_num(s.ttft_p95 * 1000):>8} {_num(s.req_per_s):>7} "
            f"{_num(s.out_tok_per_s):>7} {_num(row.hit_rate * 100):>7} {_num(s.request_hit_rate * 100):>7} "
            f"{_num(ttft_x, 2):>6} {_num(rps_x, 2):>6}  {_share(row.route_share):<12} {_share(row.engine_share)}"
        )
    bounds = format_bounds(rows, baseline)
    return "\n".join(lines + ([bounds] if bounds else []))


def format_bounds(rows: list[Row], baseline: str = BASELINE) -> str:
    """One line per row that carries the offline bound: hit rate and TTFT as fractions of the bound's,
    with TTFT p50/p90 beside the baseline's of the same cell."""
    lines = []
    for row in rows:
        if math.isnan(row.bound_hit_rate):
            continue
        s, base = row.summary, baseline_for(rows, row, baseline)
        vs = ""
        if base:
            vs = f"; {baseline} p50/p90 {_num(base.summary.ttft_p50 * 1000)}/{_num(base.ttft_p90 * 1000)} ms"
        lines.append(
            f"bound {row.workload} c={row.concurrency} run {row.run} {row.label:<14} hit {_num(row.hit_rate, 3)} = "
            f"{_num(ratio(row.hit_rate, row.bound_hit_rate), 2)} of bound {_num(row.bound_hit_rate, 3)}; "
            f"ttft p50 {_num(s.ttft_p50 * 1000)} ms = {_num(ratio(s.ttft_p50, row.bound_ttft_p50), 2)}x bound "
            f"{_num(row.bound_ttft_p50 * 1000)} ms; p90 {_num(row.ttft_p90 * 1000)} ms{vs}"
        )
    return "\n".join(lines)


def _find(rows: list[Row], label: str, workload: str, concurrency: int | None = None, routers: int = 1) -> Row | None:
    for row in rows:
        if (row.label, row.workload, row.routers) == (label, workload, routers) and concurrency in (
            None,
            row.concurrency,
        ):
            return row
    return None


def _hit_rate_a(rows: list[Row], subject: str) -> Verdict | None:
    """(a) is judged per request, as the published 99.3% is; the token-level rate is shown beside it."""
    a = _find(rows, subject, "a")
    if a is None:
        return None
    rate = a.summary.request_hit_rate
    note = f"per request (engine cached_tokens); token-level {_num(a.hit_rate, 3)}, not judged: questions and "
    note += "last partial blocks are never cached"
    if base := _find(rows, BASELINE, "a", a.concurrency):
        note += f"; {BASELINE} per request {_num(base.summary.request_hit_rate, 3)}"
    passed = not math.isnan(rate) and rate >= 0.99
    return Verdict(f"(a) {subject} request hit rate", rate, ">= 0.99", passed, note)


def _ttft_c1(rows: list[Row], subject: str, workload: str) -> Verdict | None:
    """c=1 TTFT against round robin, with the best ratio the engines' cost model allows."""
    mine, base = _find(rows, subject, workload, 1), _find(rows, BASELINE, workload, 1)
    if not (mine and base):
        return None
    x = ratio(mine.summary.ttft_p50, base.summary.ttft_p50)
    floor = ratio(mine.ttft_floor, base.summary.ttft_p50)
    note = ""
    if not math.isnan(floor):
        reach = "unattainable on this workload" if floor > 0.55 else "attainable"
        note = f"bound {floor:.3f} = perfect-cache TTFT p50 of the cost model / {BASELINE}'s: {reach}"
    return Verdict(f"({workload}) c=1 TTFT p50 vs {BASELINE}", x, "<= 0.55", x <= 0.55, note)


def _partition(rows: list[Row], subject: str) -> list[Verdict]:
    """(e): per run, the subject's hit rate against the offline bound and its TTFT against the baseline's;
    across runs on the same engines, the spread of its hit rate."""
    out = []
    mine = [r for r in rows if r.label == subject and not math.isnan(r.bound_hit_rate)]
    for row in mine:
        where = f"(e) c={row.concurrency} run {row.run}"
        share = ratio(row.hit_rate, row.bound_hit_rate)
        out.append(Verdict(f"{where} {subject} hit rate / bound's", share, ">= 0.90", share >= 0.90))
        if base := baseline_for(rows, row):
            p50 = ratio(row.summary.ttft_p50, base.summary.ttft_p50)
            p90 = ratio(row.ttft_p90, base.ttft_p90)
            out.append(Verdict(f"{where} TTFT p50 vs {BASELINE}", p50, "< 1", p50 < 1))
            out.append(Verdict(f"{where} TTFT p90 vs {BASELINE}", p90, "<= 1", p90 <= 1))
    for concurrency in sorted({r.concurrency for r in mine}):
        runs = [r.hit_rate for r in mine if r.concurrency == concurrency]
        if len(runs) > 1:
            spread = max(runs) - min(runs)
            out.append(Verdict(f"(e) c={concurrency} {subject} hit rate spread over {len(runs)} runs", spread,
                               "<= 0.03", spread <= 0.03))
    return out


def verdicts(rows: list[Row], subject: str = "kv_aware") -> list[Verdict]:
    """The targets that this run has the rows for; a target without its rows is not judged.

    (d) is judged for every number of router replicas measured: on one router ``approximate`` sees all
    the traffic, on several each of its replicas only knows what it sent itself.
    """
    out = [v for v in (_hit_rate_a(rows, subject), _ttft_c1(rows, subject, "a"), _ttft_c1(rows, subject, "b")) if v]
    mine, base = _find(rows, subject, "b", 32), _find(rows, BASELINE, "b", 32)
    if mine and base:
        x = ratio(mine.summary.req_per_s, base.summary.req_per_s)
        out.append(Verdict(f"(b) c=32 req/s vs {BASELINE}", x, ">= 0.95", x >= 0.95))
    for replicas in sorted({r.routers for r in rows if r.workload == "d" and r.label == subject}):
        mine, approx = _find(rows, subject, "d", routers=replicas), _find(rows, "approximate", "d", routers=replicas)
        if mine and approx:
            gain = mine.hit_rate - approx.hit_rate
            note = f"token-level; per request {_num(mine.summary.request_hit_rate, 3)} vs "
            note += f"{_num(approx.summary.request_hit_rate, 3)}"
            out.append(Verdict(f"(d) {replicas} router(s): hit rate minus approximate's", gain, "> 0", gain > 0, note))
    return out + _partition(rows, subject)
