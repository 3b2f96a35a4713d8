"""The sans-IO invariant checks: failure causes, recovery times, crashes and growth."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from chaos import records as rec
from chaos.invariants import (
    ALLOWED_CAUSES,
    OK,
    Limits,
    classify,
    convergence_time,
    crashes,
    down_intervals,
    evaluate,
    hit_rate_recovery,
    rejoin_time,
    resource_growth,
    route_engine,
    window_hit_rate,
)
from chaos.records import FaultAction, ProcessSample, RequestRecord, Sample

E0, E1 = "127.0.0.1:1000", "127.0.0.1:1001"
ENGINES = [E0, E1]


def action(action: str, at: float, role: str = "engine", target: str = "engine-0", engine_id: str = E0,
           done_at: float | None = None, pid: int = 7, event: int = 0) -> FaultAction:
    return FaultAction(event, "f", action, role, target, at, at if done_at is None else done_at, True, "", pid,
                       engine_id if role == "engine" else "")


def request(start: float, end: float, **kw) -> RequestRecord:
    return RequestRecord(0, start, end, **kw)


def test_route_engine_prefers_served_by():
    assert route_engine("engine=a:1; overlap=3/4; reason=x") == "a:1"
    assert route_engine("engine=a:1; reason=x; served_by=b:2; attempts=2") == "b:2"
    assert route_engine("") == "" and route_engine("garbage;;=") == ""


def test_reset_is_allowed_only_while_a_router_was_killed_in_flight():
    kill = [action(rec.KILL, 5.0, role="router", target="router-1")]
    reset = request(4.0, 5.2, error=rec.TRANSPORT)
    assert classify(reset, kill, ENGINES) == "reset_in_flight_on_killed_router"
    assert classify(request(6.0, 6.1, error=rec.TRANSPORT), kill, ENGINES) == "reset_before_first_byte"
    assert classify(request(1.0, 2.0, error=rec.INCOMPLETE, first_byte=1.5, status=200), kill,
                    ENGINES) == "reset_after_first_byte"
    assert classify(reset, [], ENGINES) == "reset_before_first_byte"


def test_mid_stream_error_is_allowed_only_from_the_engine_that_was_killed():
    kill = [action(rec.KILL, 5.0)]
    broken = request(4.0, 5.1, status=200, first_byte=4.1, error=rec.SSE_ERROR, engine=E0)
    assert classify(broken, kill, ENGINES) == "sse_error_engine_killed"
    other = request(4.0, 5.1, status=200, first_byte=4.1, error=rec.SSE_ERROR, engine=E1)
    assert classify(other, kill, ENGINES) == "sse_error_engine_alive"
    assert classify(request(6.0, 6.5, status=200, error=rec.SSE_ERROR, engine=E0), kill, ENGINES) \
        == "sse_error_engine_alive"


def test_router_5xx_is_a_violation_unless_every_engine_was_down():
    one_down = [action(rec.KILL, 1.0), action(rec.RESTART, 3.0, done_at=4.0)]
    assert classify(request(2.0, 2.1, status=503), one_down, ENGINES) == "router_error_503"
    both = one_down + [action(rec.PAUSE, 1.5, target="engine-1", engine_id=E1),
                       action(rec.RESUME, 2.5, target="engine-1", engine_id=E1)]
    assert classify(request(2.0, 2.1, status=503), both, ENGINES) == "router_error_all_engines_down"
    assert classify(request(3.5, 3.6, status=503), both, ENGINES) == "router_error_503"
    assert classify(request(2.0, 2.1, status=400), both, ENGINES) == "router_error_400"


def test_down_interval_stays_open_without_a_heal():
    intervals = down_intervals([action(rec.STOP, 2.0)])
    assert intervals == {E0: [(2.0, math.inf)]}


@given(st.floats(0, 100), st.floats(0, 10), st.sampled_from([rec.TIMEOUT, rec.MALFORMED, rec.TRANSPORT,
                                                               rec.SSE_ERROR, rec.INCOMPLETE, ""]),
       st.sampled_from([0, 200, 500, 503, 429]))
def test_every_failure_gets_a_cause_and_nothing_fails_silently(start, length, error, status):
    record = request(start, start + length, error=error, status=status, engine=E0)
    cause = classify(record, [], ENGINES)
    assert (cause == OK) == record.ok
    assert cause not in ALLOWED_CAUSES  # with no fault at all, no failure is excused


def counters(hits: float, queries: float) -> dict[str, float]:
    return {"vllm:prefix_cache_hits_total": hits, "vllm:prefix_cache_queries_total": queries}


def test_window_hit_rate_is_token_weighted_and_survives_counter_reset():
    samples = [Sample(0.0, counters={"a": counters(0, 0), "b": counters(50, 100)}),
               Sample(1.0, counters={"a": counters(90, 100), "b": counters(10, 100)})]
    # a: +90/+100; b restarted (counter went down): its value after is the increase, 10/100.
    assert window_hit_rate(samples, 0.0, 1.0) == 100 / 200
    assert math.isnan(window_hit_rate(samples[:1], 0.0, 1.0))


def rising(rate_by_time, until: float, step: float = 0.5) -> list[Sample]:
    out, hits, queries, t = [], 0.0, 0.0, 0.0
    while t <= until:
        out.append(Sample(t, counters={"e": counters(hits, queries)}))
        hits += 100 * rate_by_time(t)
        queries += 100
        t += step
    return out


def test_hit_rate_recovery_measures_from_heal_to_a_good_window():
    samples = rising(lambda t: 0.8 if t < 10 or t >= 14 else 0.0, 30)
    pre, back = hit_rate_recovery(samples, 0.0, 10.0, 12.0, 30.0, Limits())
    assert abs(pre - 0.8) < 1e-9
    assert back is not None and 12.0 + back >= 14.0 + Limits().window_s
    _, never = hit_rate_recovery(rising(lambda t: 0.8 if t < 10 else 0.0, 30), 0.0, 10.0, 12.0, 30.0, Limits())
    assert never is None


def test_convergence_needs_every_replica_to_answer_with_the_same_content():
    a, b = {"e": "1:1"}, {"e": "2:2"}
    samples = [Sample(1.0, indexes={"r0": a, "r1": None}), Sample(2.0, indexes={"r0": a, "r1": b}),
               Sample(3.0, indexes={"r0": b, "r1": b})]
    assert convergence_time(samples, ["r0", "r1"], 0.5, 10.0) == 2.5
    assert convergence_time(samples, ["r0", "r1"], 0.5, 2.5) is None


def test_rejoin_counts_from_healthy_to_first_request_routed_there():
    records = [request(1.0, 1.1, engine=E0), request(5.5, 5.6, engine=E1), request(6.2, 6.3, engine=E0)]
    assert rejoin_time(records, E0, 5.0, 20.0) == 6.2 - 5.0
    assert rejoin_time(records, E0, 7.0, 20.0) is None


def proc(pid: int, alive: bool = True, rss: int = 1000, fds: int = 10) -> ProcessSample:
    return ProcessSample(pid, alive, rss, fds)


def test_only_unexplained_deaths_are_crashes():
    samples = [Sample(1.0, processes={"router-0": proc(7), "router-1": proc(8)}),
               Sample(2.0, processes={"router-0": proc(7, False), "router-1": proc(8, False)})]
    killed = [action(rec.KILL, 1.5, role="router", target="router-0", pid=7)]
    assert crashes(samples, killed) == ["router-1 (pid 8)"]


def test_growth_baseline_waits_for_warm_up_after_restart():
    samples = [Sample(float(t), processes={"r": proc(9, rss=1000 + 100 * t, fds=5 + t)}) for t in range(10)]
    (g,) = resource_growth(samples, 0.0, 3.0, {("r", 9): 4.0})
    assert (g.rss_start_kb, g.rss_end_kb, g.fds_start, g.fds_end) == (1700, 1900, 12, 14)


def test_evaluate_flags_the_violations_and_keeps_allowed_failures():
    kill = action(rec.KILL, 5.0, role="router", target="router-1", pid=8, event=0)
    restart = action(rec.RESTART, 7.0, role="router", target="router-1", pid=9, done_at=8.0, event=0)
    same = {"e": "x"}
    samples = [Sample(t / 2, processes={"router-0": proc(3),
                                        "router-1": proc(8 if t < 16 else 9, alive=not 10 <= t < 16)},
                      indexes={"router-0": same, "router-1": same}, counters={"e": counters(t * 80, t * 100)})
               for t in range(40)]
    records = [request(4.0, 5.1, error=rec.TRANSPORT), request(1.0, 1.2, status=200)]
    ev = evaluate(records, [kill, restart], samples, ["router-0", "router-1"], ENGINES, 20.0, 1.0)
    assert all(ev.invariants.values()), ev.invariants
    assert ev.causes == {OK: 1, "reset_in_flight_on_killed_router": 1} and ev.violations == {}
    bad = evaluate(records + [request(9.0, 9.1, status=502)], [kill, restart], samples,
                   ["router-0", "router-1"], ENGINES, 20.0, 1.0)
    assert not bad.invariants["no_engine_fault_leaked_before_first_byte"]
    assert bad.violations == {"router_error_502": 1}


def test_under_streaming_load_a_killed_engines_sse_error_is_a_violation_and_continuations_are_timed():
    kill = action(rec.KILL, 5.0)
    continued = request(4.0, 6.0, status=200, first_byte=4.1, engine=E0, token_times=[4.2, 4.9, 5.04, 5.1])
    elsewhere = request(4.0, 6.0, status=200, first_byte=4.1, engine=E1, token_times=[4.2, 5.5])
    broken = request(4.0, 5.1, status=200, first_byte=4.1, error=rec.SSE_ERROR, engine=E0, token_times=[4.2])
    lenient = evaluate([continued, elsewhere, broken], [kill], [], [], ENGINES, 10.0, 1.0)
    assert "no_client_visible_failure_while_an_engine_lives" not in lenient.invariants
    assert all(lenient.invariants[k] for k in ("mid_stream_errors_only_from_killed_engines",
                                               "no_other_request_failures"))
    strict = evaluate([continued, elsewhere, broken], [kill], [], [], ENGINES, 10.0, 1.0, streams_continue=True)
    assert strict.invariants["no_client_visible_failure_while_an_engine_lives"] is False
    assert strict.violations == {"sse_error_engine_killed": 1}
    assert [round(t, 3) for t in strict.continued] == [0.04]
    assert evaluate([continued, elsewhere], [kill], [], [], ENGINES, 10.0, 1.0,
                    streams_continue=True).invariants["no_client_visible_failure_while_an_engine_lives"]
