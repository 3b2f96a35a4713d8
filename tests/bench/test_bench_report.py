"""Table ratios, target verdicts and route-header parsing."""

from __future__ import annotations

import math

import pytest

from bench.overhead import block_order
from bench.report import Row, format_table, verdicts
from bench.runner import engine_of
from bench.stats import RequestResult, summarize


def _row(label, workload, c, ttft, rps, hit, request_hits=None, routers=1, floor=math.nan):
    """``rps`` successful requests; the first ``request_hits`` of them found their shared prefix cached."""
    hits = int(rps) if request_hits is None else request_hits
    results = [
        RequestResult(status=200, ttft=ttft, total=ttft, reusable_tokens=32, cached_tokens=32 if i < hits else 16)
        for i in range(int(rps))
    ]
    summary = summarize(results, wall=1.0)
    return Row(label, workload, c, summary, hit, [0.5, 0.5, 0.0], [0.4, 0.6, 0.0], routers, floor)


def test_table_shows_ratios_against_round_robin_of_the_same_cell():
    rows = [_row("round_robin", "b", 1, 0.2, 10, 0.3), _row("kv_aware", "b", 1, 0.1, 12, 0.9)]
    table = format_table(rows).splitlines()
    kv = next(line for line in table if "kv_aware" in line)
    assert " 0.50 " in kv and " 1.20 " in kv and "90.0" in kv and "50/50/0" in kv and "40/60/0" in kv
    assert "tok hit" in table[0] and "req hit" in table[0] and " 100.0 " in kv


def test_ratios_compare_only_rows_behind_as_many_routers():
    rows = [_row("round_robin", "d", 8, 0.2, 10, 0.3), _row("kv_aware", "d", 8, 0.1, 12, 0.9, routers=2)]
    kv = format_table(rows).splitlines()[-1]
    assert kv.split()[2] == "2" and kv.split()[-4:-2] == ["-", "-"]


def test_verdicts_judge_only_targets_with_rows():
    assert verdicts([_row("kv_aware", "b", 8, 0.1, 10, 0.9)]) == []
    rows = [
        _row("kv_aware", "a", 1, 0.08, 100, 0.95, request_hits=99),
        _row("round_robin", "a", 1, 0.16, 100, 0.4, request_hits=41),
        _row("kv_aware", "b", 32, 0.1, 94, 0.9),
        _row("round_robin", "b", 32, 0.1, 100, 0.5),
        _row("kv_aware", "d", 8, 0.1, 10, 0.5),
        _row("approximate", "d", 8, 0.1, 10, 0.5),
    ]
    got = {v.target: v.passed for v in verdicts(rows)}
    assert got == {
        "(a) kv_aware request hit rate": True,
        "(a) c=1 TTFT p50 vs round_robin": True,
        "(b) c=32 req/s vs round_robin": False,
        "(d) 1 router(s): hit rate minus approximate's": False,
    }


def test_a_is_judged_per_request_not_per_token():
    rows = [_row("kv_aware", "a", 1, 0.08, 100, 0.999, request_hits=98)]
    (verdict,) = verdicts(rows)
    assert (verdict.value, verdict.passed) == (0.98, False)
    assert "token-level 0.999" in verdict.line()


def test_ttft_target_prints_the_cost_model_bound():
    rows = [_row("kv_aware", "b", 1, 0.09, 10, 0.9, floor=0.078), _row("round_robin", "b", 1, 0.1, 10, 0.9)]
    (verdict,) = verdicts(rows)
    assert not verdict.passed and "bound 0.780" in verdict.line() and "unattainable" in verdict.line()
    rows[0].ttft_floor = 0.04
    assert "bound 0.400" in verdicts(rows)[0].line() and "unattainable" not in verdicts(rows)[0].line()


def test_d_is_judged_for_each_router_count():
    rows = [
        _row("kv_aware", "d", 8, 0.1, 10, 0.60),
        _row("approximate", "d", 8, 0.1, 10, 0.62),
        _row("kv_aware", "d", 8, 0.1, 10, 0.60, routers=2),
        _row("approximate", "d", 8, 0.1, 10, 0.45, routers=2),
    ]
    one, two = verdicts(rows)
    assert one.target.startswith("(d) 1 router(s)") and not one.passed
    assert one.value == pytest.approx(-0.02)
    assert two.target.startswith("(d) 2 router(s)") and two.passed
    assert two.value == pytest.approx(0.15)


def test_missing_baseline_leaves_ratio_blank():
    table = format_table([_row("kv_aware", "a", 1, 0.1, 5, math.nan)])
    assert table.splitlines()[-1].split()[-4:-2] == ["-", "-"]


def test_engine_of_route_header():
    assert engine_of("127.0.0.1:8101") == "127.0.0.1:8101"
    assert engine_of("127.0.0.1:8101; overlap=12; score=0.1") == "127.0.0.1:8101"
    assert engine_of("engine=e2, attempts=1") == "e2"


def test_block_order_alternates_who_goes_first():
    assert block_order(3) == ["direct", "router", "router", "direct", "direct", "router"]


def _bounded(label, run, ttft, p90, hit, bound_hit=0.9):
    row = _row(label, "e", 4, ttft, 10, hit)
    row.run, row.ttft_p90, row.bound_hit_rate, row.bound_ttft_p50 = run, p90, bound_hit, 0.08
    return row


def test_bounded_rows_print_fractions_of_the_bound_next_to_round_robin():
    rows = [_bounded("kv_aware", 1, 0.12, 0.15, 0.855), _bounded("round_robin", 1, 0.15, 0.2, 0.3)]
    line = next(x for x in format_table(rows).splitlines() if x.startswith("bound") and "kv_aware" in x)
    assert "hit 0.855 = 0.95 of bound 0.900" in line and "1.50x bound 80.0 ms" in line
    assert "p90 150.0 ms; round_robin p50/p90 150.0/200.0 ms" in line


def test_partition_targets_per_run_and_their_spread():
    rows = [
        _bounded("kv_aware", 1, 0.12, 0.15, 0.86), _bounded("round_robin", 1, 0.15, 0.2, 0.3),
        _bounded("kv_aware", 2, 0.12, 0.25, 0.80), _bounded("round_robin", 2, 0.15, 0.2, 0.3),
    ]
    got = {v.target: v.passed for v in verdicts(rows)}
    assert got == {
        "(e) c=4 run 1 kv_aware hit rate / bound's": True,
        "(e) c=4 run 1 TTFT p50 vs round_robin": True,
        "(e) c=4 run 1 TTFT p90 vs round_robin": True,
        "(e) c=4 run 2 kv_aware hit rate / bound's": False,
        "(e) c=4 run 2 TTFT p50 vs round_robin": True,
        "(e) c=4 run 2 TTFT p90 vs round_robin": False,
        "(e) c=4 kv_aware hit rate spread over 2 runs": False,
    }
