"""The autoscaling benchmark's arithmetic: trace, traffic mix, engine-seconds, SLO windows, verdicts."""

import math

from bench.autoscale_trace import RunRecord, Trace, TrafficMix, direction_changes, judge, served_by
from bench.stats import RequestResult


def test_trace_has_quiet_burst_and_diurnal_phases():
    trace = Trace(100, 10)
    assert [p[0] for p in trace.phases()] == ["quiet", "burst", "quiet", "diurnal"]
    assert trace.rate(5) == 1.5 and trace.rate(20) == 8.0 and trace.rate(70) == 10.0
    arrivals = trace.arrivals()
    assert arrivals == sorted(arrivals) and abs(len(arrivals) - trace.mean_rps() * 100) < 1
    assert sum(1 for t in arrivals if t < 13) < sum(1 for t in arrivals if 60 <= t < 73)


def test_mix_sends_chat_turns_in_order_and_shares_system_prompts():
    mix = TrafficMix(seed=1, chat_share=0.5)
    sent = [mix.next() for _ in range(40)]
    chats = [c for c in sent if c.key.startswith("chat")]
    assert chats and len({c.system for c in sent if c.key.startswith("s")}) <= 6
    busy = chats[0]
    assert busy.key in mix.busy
    mix.answered(busy, "an answer")
    assert busy.sent == 1 and busy.key not in mix.busy


def record(samples, results=(), decisions=()) -> RunRecord:
    return RunRecord("x", list(results), samples, 3600.0, 10.0, list(decisions))


def test_engine_seconds_integrates_the_step_function():
    assert record([(0, 2), (5, 4)]).engine_seconds() == 30.0
    assert record([(0, 1)]).cost() == 10.0


def test_window_p99_counts_failures_as_misses():
    results = [RequestResult(started=0.5, status=200, ttft=0.1), RequestResult(started=6.0, status=500)]
    run = record([(0, 1)], results)
    assert run.window_p99(5.0)[0] == 0.1 and math.isinf(run.window_p99(5.0)[1])
    assert run.slo_windows(5.0, 1.0) == (1, 2)


def test_direction_changes_and_verdicts():
    decisions = [{"at": 0, "action": "up", "count": 1}, {"at": 5, "action": "hold"},
                 {"at": 20, "action": "down", "count": 1}, {"at": 25, "action": "up", "count": 1}]
    assert direction_changes(decisions) == [20.0, 25.0]
    ok = [RequestResult(started=t, status=200, ttft=0.1) for t in range(10)]
    auto = record([(0, 1), (5, 2)], ok, decisions)
    peak = record([(0, 5)], ok)
    verdicts = judge(auto, peak, record([(0, 1)], ok), 1.0, 1.0, cooldown_s=10, lease=(2.5, 1))
    passed = {v.target: v.passed for v in verdicts}
    assert passed["engine-seconds vs peak-sized fleet"] and passed["minutes with TTFT p99 within the ceiling"]
    assert passed["failed requests across scale-downs"]
    assert not passed["changes of direction per cooldown window"]
    assert passed["lease handover after killing its holder (s)"]
    assert all(v.line().startswith(("PASS", "FAIL")) for v in verdicts)


def test_scale_down_failures_count_released_engines_and_broken_streams_only():
    decisions = [{"at": 1, "action": "down", "count": 1, "release": ["local-1"]}]
    results = [RequestResult(status=429),
               RequestResult(status=200, error="stream ended early", route="engine=local-2; reason=x"),
               RequestResult(status=502, route="engine=local-9; served_by=local-1; attempts=2"),
               RequestResult(status=200, ttft=0.1, route="engine=local-1")]
    run = record([(0, 1)], results, decisions)
    assert served_by("engine=a; served_by=b; attempts=2") == "b" and served_by("") == ""
    assert run.scale_down_failures() == 2 and run.failed == 3
