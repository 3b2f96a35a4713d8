"""Table ratios, target verdicts and route-header parsing."""

from __future__ import annotations

import math

from bench.overhead import block_order
from bench.report import Row, format_table, verdicts
from bench.runner import engine_of
from bench.stats import RequestResult, summarize


def _row(label, workload, c, ttft, rps, hit):
    results = [RequestResult(status=200, ttft=ttft, total=ttft) for _ in range(int(rps))]
    return Row(label, workload, c, summarize(results, wall=1.0), hit, [0.5, 0.5, 0.0], [0.4, 0.6, 0.0])


def test_table_shows_ratios_against_round_robin_of_the_same_cell():
    rows = [_row("round_robin", "b", 1, 0.2, 10, 0.3), _row("kv_aware", "b", 1, 0.1, 12, 0.9)]
    table = format_table(rows).splitlines()
    kv = next(line for line in table if "kv_aware" in line)
    assert " 0.50 " in kv and " 1.20 " in kv and "90.0" in kv and "50/50/0" in kv and "40/60/0" in kv


def test_verdicts_judge_only_targets_with_rows():
    assert verdicts([_row("kv_aware", "b", 8, 0.1, 10, 0.9)]) == []
    rows = [
        _row("kv_aware", "a", 1, 0.08, 10, 0.995),
        _row("round_robin", "a", 1, 0.16, 10, 0.4),
        _row("kv_aware", "b", 32, 0.1, 94, 0.9),
        _row("round_robin", "b", 32, 0.1, 100, 0.5),
        _row("kv_aware", "d", 8, 0.1, 10, 0.5),
        _row("approximate", "d", 8, 0.1, 10, 0.5),
    ]
    got = {v.target: v.passed for v in verdicts(rows)}
    assert got == {
        "(a) kv_aware engine hit rate": True,
        "(a) c=1 TTFT p50 vs round_robin": True,
        "(b) c=32 req/s vs round_robin": False,
        "(d) hit rate minus approximate's": False,
    }


def test_missing_baseline_leaves_ratio_blank():
    table = format_table([_row("kv_aware", "a", 1, 0.1, 5, math.nan)])
    assert table.splitlines()[-1].split()[-4:-2] == ["-", "-"]


def test_engine_of_route_header():
    assert engine_of("127.0.0.1:8101") == "127.0.0.1:8101"
    assert engine_of("127.0.0.1:8101; overlap=12; score=0.1") == "127.0.0.1:8101"
    assert engine_of("engine=e2, attempts=1") == "e2"


def test_block_order_alternates_who_goes_first():
    assert block_order(3) == ["direct", "router", "router", "direct", "direct", "router"]
