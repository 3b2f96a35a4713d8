"""The suite's shape generator (ranges, one suite per seed) and its report's arithmetic and verdicts."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import engine_stats
from bench import suite_shapes as shapes
from bench.report import Row
from bench.stats import RequestResult, summarize
from bench.suite import Entry, chosen_shapes, entries, rotated
from bench.suite_report import (
    ShapeRun,
    format_overall,
    format_reruns,
    format_shapes,
    fraction,
    overall,
    plot,
    ttft_ratios,
    verdicts,
)
from sim.profiles import get_profile

A40 = get_profile("a40-qwen1.5b")


def test_a_seed_draws_the_same_suite_and_another_seed_a_different_one():
    assert shapes.draw_suite(7, 20) == shapes.draw_suite(7, 20)
    assert shapes.draw_suite(7, 20) != shapes.draw_suite(8, 20)
    assert shapes.draw_suite(7, 6) == shapes.draw_suite(7, 20)[:6]
    one, two = shapes.plan(shapes.draw_suite(3, 1)[0], A40, 5.0), shapes.plan(shapes.draw_suite(3, 1)[0], A40, 5.0)
    assert [(c.key, c.system, c.user_turns) for c in one.conversations] == [
        (c.key, c.system, c.user_turns) for c in two.conversations]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_every_drawn_shape_stays_in_its_ranges(seed):
    for shape in shapes.draw_suite(seed, 5):
        assert shape.kind in shapes.KINDS
        assert shapes.PREFIXES[0] <= shape.prefixes <= shapes.PREFIXES[1]
        assert all(shapes.PREFIX_TOKENS[0] <= n <= shapes.PREFIX_TOKENS[1] for n in shape.prefix_tokens)
        assert shapes.ZIPF[0] <= shape.zipf <= shapes.ZIPF[1]
        assert shapes.ANSWER_TOKENS[0] <= shape.answer_tokens <= shapes.ANSWER_TOKENS[1]
        assert shapes.ENGINES[0] <= shape.engines <= shapes.ENGINES[1]
        assert shapes.CAPACITY[0] <= shape.capacity_ratio <= shapes.CAPACITY[1]
        assert shapes.CONCURRENCY[0] <= shape.concurrency <= shapes.CONCURRENCY[1]
        low, high = shapes.TURNS[shape.kind]
        assert low <= shape.turns[0] <= shape.turns[1] <= high


def test_the_ranges_are_all_visited_over_many_shapes():
    drawn = shapes.draw_suite(0, 300)
    assert set(Counter(s.kind for s in drawn)) == set(shapes.KINDS)
    assert {s.open_loop for s in drawn} == {True, False}
    assert min(s.prefixes for s in drawn) <= 3 and max(s.prefixes for s in drawn) >= 48
    assert min(s.answer_tokens for s in drawn) <= 2 and max(s.answer_tokens for s in drawn) >= 300
    assert min(s.concurrency for s in drawn) == 1 and max(s.concurrency for s in drawn) >= 48
    assert min(s.zipf for s in drawn) < 0.1 and max(s.zipf for s in drawn) > 1.3


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_a_plan_sends_the_shape_sized_to_the_budget(seed):
    shape = shapes.draw_suite(seed, 1)[0]
    planned = shapes.plan(shape, A40, 5.0)
    sent = sum(len(c.user_turns) for c in planned.conversations)
    assert shapes.REQUESTS[0] <= sent <= shapes.REQUESTS[1]
    assert shapes.MIN_TIME_SCALE <= planned.time_scale <= 1.0
    assert (planned.arrival_rate is not None) == shape.open_loop
    assert {c.max_tokens for c in planned.conversations} == {shape.answer_tokens}
    low, high = shapes.TURNS[shape.kind]
    assert all(len(c.user_turns) <= high for c in planned.conversations)
    systems = {c.system for c in planned.conversations}
    assert len(systems) <= shape.prefixes
    # an engine admits any one request whole: twice the largest in blocks, at least
    largest = max(shape.prefix_tokens) + shape.request_tokens()
    assert shape.num_blocks(16) * 16 >= 2 * largest


def test_kv_capacity_follows_the_ratio_of_the_working_set():
    base = shapes.draw_suite(1, 1)[0]
    small = shapes.Shape(**{**base.__dict__, "kind": "single", "turns": (1, 1), "prefix_tokens": (4000,) * 40,
                            "engines": 4, "capacity_ratio": 0.5})
    big = shapes.Shape(**{**small.__dict__, "capacity_ratio": 3.0})
    assert small.working_set_tokens() == 160_000
    assert small.num_blocks(16) == math.ceil(0.5 * 160_000 / 4 / 16) + 1
    assert big.num_blocks(16) == math.ceil(3.0 * 160_000 / 4 / 16) + 1


def test_popularity_zero_is_uniform_and_high_is_skewed():
    base = shapes.draw_suite(2, 1)[0]
    flat = shapes.Shape(**{**base.__dict__, "kind": "single", "turns": (1, 1), "prefix_tokens": (300,) * 8,
                           "zipf": 0.0})
    skewed = shapes.Shape(**{**flat.__dict__, "zipf": 1.4})

    def top_share(shape):
        counts = Counter(c.system for c in shapes.conversations(shape, 2000))
        return max(counts.values()) / 2000

    assert top_share(flat) < 0.2 < 0.4 < top_share(skewed)


def _row(label, hit, bound, ttfts, routers=1):
    results = [RequestResult(status=200, ttft=t, total=t) for t in ttfts]
    row = Row(label, "#1", 4, summarize(results, 1.0), hit, routers=routers, bound_hit_rate=bound)
    row.ttft_p90, row.ttft_p99 = sorted(ttfts)[-2], sorted(ttfts)[-1]
    return row


def _run(index, rows):
    return ShapeRun(shapes.draw_suite(0, index)[index - 1], 1.0, 100, rows)


def test_fraction_and_ttft_ratios_against_round_robin():
    rr = _row("round_robin", 0.3, 0.8, [0.1, 0.2, 0.4, 0.5])
    kv = _row("kv_aware", 0.76, 0.8, [0.05, 0.1, 0.2, 1.0])
    assert fraction(kv) == pytest.approx(0.95)
    assert math.isnan(fraction(_row("x", 0.5, math.nan, [0.1, 0.2])))
    x50, x90, x99 = ttft_ratios(kv, rr)
    assert x50 == pytest.approx(0.15 / 0.3) and x90 == pytest.approx(0.5) and x99 == pytest.approx(2.0)
    assert all(math.isnan(x) for x in ttft_ratios(kv, None))


def test_overall_means_over_shapes_and_counts_tail_losses():
    runs = [
        _run(1, [_row("round_robin", 0.3, 0.8, [0.1, 0.2, 0.4, 0.5]), _row("kv_aware", 0.8, 0.8, [0.1, 0.1, 0.3, 0.5]),
                 _row("smg:cache_aware", 0.7, 0.8, [0.1, 0.2, 0.4, 0.5])]),
        _run(2, [_row("round_robin", 0.3, 0.6, [0.1, 0.2, 0.4, 0.5]), _row("kv_aware", 0.48, 0.6, [0.1, 0.2, 0.5, 0.6]),
                 _row("smg:cache_aware", 0.6, 0.6, [0.1, 0.2, 0.4, 0.5])]),
    ]
    kv = overall(runs, "kv_aware")
    assert kv.shapes == 2 and kv.mean_fraction == pytest.approx(0.9) and kv.min_fraction == pytest.approx(0.8)
    assert kv.mean_hit == pytest.approx(0.64)
    assert kv.p90_worse == 1 and kv.p99_worse == 1
    judged = {v.target: v for v in verdicts(runs)}
    assert not judged["kv_aware mean fraction of bound"].passed
    assert not judged["kv_aware lowest fraction of bound"].passed
    assert not judged["kv_aware shapes with TTFT p90 worse than round_robin"].passed
    assert not judged["kv_aware mean hit minus smg:cache_aware's"].passed
    assert "kv_aware" in format_overall(runs) and "#2" in format_shapes(runs)


def test_meshed_replicas_are_judged_against_one_router():
    rr = [0.1, 0.2, 0.3, 0.4]
    runs = [_run(1, [_row("round_robin", 0.3, 0.8, rr), _row("kv_aware", 0.8, 0.8, rr),
                     _row("kv_aware x3", 0.76, 0.8, rr, routers=3)])]
    judged = {v.target: v for v in verdicts(runs)}
    meshed = judged["kv_aware x3 mean fraction of bound below one router's"]
    assert meshed.value == pytest.approx(0.05) and not meshed.passed
    assert all(v.passed for k, v in judged.items() if k != meshed.target)


def test_entries_add_meshed_replicas_only_when_asked(tmp_path):
    assert entries(["kv_aware", "round_robin"], ["kv_aware"], 3) == [
        Entry("kv_aware", 1), Entry("round_robin", 1), Entry("kv_aware", 3)]
    assert entries(["kv_aware"], ["kv_aware"], 0) == [Entry("kv_aware", 1)]
    assert Entry("kv_aware", 3).label == "kv_aware x3"
    runs = [_run(1, [_row("round_robin", 0.3, 0.8, [0.1, 0.2]), _row("kv_aware", 0.8, 0.8, [0.1, 0.2])])]
    plot(runs, tmp_path / "suite.png")
    assert (tmp_path / "suite.png").read_bytes()[:4] == b"\x89PNG"


def test_a_killing_entry_is_added_beside_the_meshed_one_and_judged_against_one_router():
    todo = entries(["kv_aware"], ["kv_aware"], 3, mesh_kill=True)
    assert [e.label for e in todo] == ["kv_aware", "kv_aware x3", "kv_aware x3>2"]
    assert entries(["kv_aware"], ["kv_aware"], 0, mesh_kill=True) == [Entry("kv_aware", 1)]
    rr = [0.1, 0.2, 0.3, 0.4]
    killed = _row("kv_aware x3>2", 0.72, 0.8, rr, routers=3)
    killed.late_hit_rate = 0.61
    runs = [_run(1, [_row("round_robin", 0.3, 0.8, rr), _row("kv_aware", 0.8, 0.8, rr),
                     _row("kv_aware x3", 0.8, 0.8, rr, routers=3), killed])]
    judged = {v.target: v for v in verdicts(runs)}
    assert judged["kv_aware x3 mean fraction of bound below one router's"].passed
    after = judged["kv_aware x3>2 mean fraction of bound below one router's"]
    assert after.value == pytest.approx(0.1) and not after.passed
    line = next(x for x in format_shapes(runs).splitlines() if "x3>2" in x)
    assert "0.610" in line.split() and "0.90" in line.split()


def test_a_suite_without_round_robin_judges_no_tail():
    rr = [0.1, 0.2, 0.3, 0.4]
    runs = [_run(1, [_row("kv_aware", 0.8, 0.8, rr), _row("kv_aware x3", 0.8, 0.8, rr, routers=3)])]
    judged = [v.target for v in verdicts(runs)]
    assert not any("TTFT" in t for t in judged) and any("x3" in t for t in judged)


def test_each_shape_measures_a_different_entry_first():
    todo = entries(["kv_aware", "approximate", "round_robin"], ["kv_aware"], 3)
    firsts = [rotated(todo, shape)[0] for shape in shapes.draw_suite(0, 4)]
    assert firsts == [todo[0], todo[1], todo[2], todo[3]]
    assert all(sorted(rotated(todo, s), key=todo.index) == todo for s in shapes.draw_suite(0, 4))


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_a_plan_counts_its_longest_session_and_overruns_only_at_both_floors(seed):
    shape = shapes.draw_suite(seed, 1)[0]
    planned = shapes.plan(shape, A40, 4.0)
    per_request = shapes.service_s(shape, A40)
    sent = sum(len(c.user_turns) for c in planned.conversations)
    wall = shapes.wall_s(shape, per_request, sent) * planned.time_scale
    longest = max(len(c.user_turns) for c in planned.conversations)
    assert wall >= per_request * planned.time_scale * longest * (1 - 1e-9)
    at_floors = sent == shapes.REQUESTS[0] and planned.time_scale == shapes.MIN_TIME_SCALE
    assert wall <= 4.0 * 1.01 or at_floors


def test_one_shape_of_a_suite_is_rerun_as_drawn():
    assert chosen_shapes(0, 6, frozenset({12})) == [shapes.draw_suite(0, 20)[11]]
    assert chosen_shapes(0, 6) == shapes.draw_suite(0, 6)


def test_a_shape_line_splits_time_outside_the_engines_and_counts_engines_that_served():
    rr = [0.1, 0.2, 0.3, 0.4]
    kv = _row("kv_aware", 0.8, 0.8, rr)
    kv.outside_engines_s, kv.engine_share = 0.0123, [0.5, 0.0, 0.5, 0.0]
    line = next(x for x in format_shapes([_run(1, [_row("round_robin", 0.3, 0.8, rr), kv])]).splitlines()
                if x.split()[:1] == ["kv_aware"])
    assert line.split()[-5:] == ["12.3", "2", "0.50", "-", "-"]
    assert overall([_run(1, [kv])], "kv_aware").out_s == pytest.approx(0.0123)
    assert format_overall([_run(1, [kv])]).splitlines()[-1].split()[-2:] == ["12.3", "-"]
    assert engine_stats.fleet_engine_ttft([
        {engine_stats.TTFT_SUM: 0.3, engine_stats.TTFT_COUNT: 3.0},
        {engine_stats.TTFT_SUM: 0.5, engine_stats.TTFT_COUNT: 1.0}, {}]) == pytest.approx(0.2)
    assert math.isnan(engine_stats.fleet_engine_ttft([{}]))


def test_a_shape_line_shows_the_routers_cpu_per_request_and_how_busy_the_machine_was():
    rr = [0.1, 0.2, 0.3, 0.4]
    kv, smg = _row("kv_aware", 0.8, 0.8, rr), _row("smg:cache_aware", 0.8, 0.8, rr)
    kv.router_cpu_s, kv.busy_cores, smg.router_cpu_s = 0.0046, 1.83, 0.0021
    text = format_shapes([_run(1, [_row("round_robin", 0.3, 0.8, rr), kv, smg])]).splitlines()
    line = next(x for x in text if x.split()[:1] == ["kv_aware"])
    assert line.split()[-2:] == ["4.6", "1.8"]
    runs = [_run(1, [kv, smg]), _run(2, [_row("kv_aware", 0.8, 0.8, rr)])]
    assert overall(runs, "kv_aware").router_cpu_s == pytest.approx(0.0046)  # a shape without it is left out
    assert format_overall(runs).splitlines()[-1].split()[-1] == "2.1"


def test_a_policy_listed_twice_runs_again_and_its_rerun_is_set_against_its_first_run():
    todo = entries(["kv_aware", "round_robin", "kv_aware", "round_robin"], ["kv_aware"], 3)
    assert [e.label for e in todo] == ["kv_aware", "round_robin", "kv_aware #2", "round_robin #2", "kv_aware x3"]
    assert format_reruns([_run(1, [_row("round_robin", 0.3, 0.8, [0.1, 0.2])])]) == ""
    runs = [
        _run(1, [_row("round_robin", 0.3, 0.8, [0.1, 0.2, 0.3, 0.4]), _row("kv_aware", 0.8, 0.8, [0.1, 0.1, 0.2, 0.3]),
                 _row("round_robin #2", 0.3, 0.8, [0.1, 0.2, 0.35, 0.5]),
                 _row("kv_aware #2", 0.72, 0.8, [0.1, 0.1, 0.2, 0.3])]),
        _run(2, [_row("round_robin", 0.3, 0.6, [0.1, 0.2, 0.3, 0.4]), _row("kv_aware", 0.6, 0.6, [0.1, 0.1, 0.2, 0.3]),
                 _row("round_robin #2", 0.3, 0.6, [0.1, 0.2, 0.3, 0.4]),
                 _row("kv_aware #2", 0.6, 0.6, [0.1, 0.1, 0.25, 0.3])]),
    ]
    rerun = overall(runs, "round_robin #2", base="round_robin")
    assert rerun.p90_worse == 1 and rerun.p99_worse == 1  # 0.35 > 0.3, and 0.5 > 1.1 x 0.4, on shape 1 only
    lines = {line.split()[0] + " " + line.split()[1]: line.split() for line in format_reruns(runs).splitlines()[3:]}
    assert lines["kv_aware #2"][2:5] == ["kv_aware", "-0.050", "-0.040"]  # fractions 0.9 and 1.0 against 1.0
    assert lines["kv_aware #2"][-2:] == ["1", "0"]  # p90 0.25 over 0.2 on shape 2, p99 equal
    assert lines["round_robin #2"][-2:] == ["1", "1"]
    judged = [v.target for v in verdicts(runs)]
    assert not any("#2" in target for target in judged)  # a rerun is the noise floor, not a judged entry
