"""Sans-IO invariant checks over what a chaos run recorded: requests, fault actions, monitor samples.

Every failed request is given a cause, and each cause is either explained by a fault (allowed) or a
violation. The other checks measure recovery after each fault heals: index convergence across
replicas, the fleet's prefix-cache hit rate, and how soon a restarted engine is routed to again. On a
cluster with an autoscaler they also hold the lease to its promise: never two actors, no provision made
twice, an actor again once the holder is gone.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from bench.engine_stats import HITS, QUERIES
from chaos.records import (
    ENDS_PROCESS,
    INCOMPLETE,
    KILL,
    MALFORMED,
    PAUSE,
    RESTART,
    RESUME,
    SSE_ERROR,
    TIMEOUT,
    TRANSPORT,
    FaultAction,
    RequestRecord,
    Sample,
)
from chaos.scenarios import HOLDER_FAULTS
from cluster.router_config import FLOOD_TENANT

OK = "ok"
FLOOD_REFUSED = "flood_tenant_refused_429"
"""The flooding tenant told to slow down (its rate, its share of the tokenizer): the router's choice, not a
failure, and no other tenant's request may get it."""
ALLOWED_CAUSES = frozenset({"reset_in_flight_on_killed_router", "sse_error_engine_killed",
                            "router_error_all_engines_down", FLOOD_REFUSED})


@dataclass(frozen=True)
class Limits:
    """The thresholds the invariants hold to, plus the measurement knobs that are not in it."""

    convergence_s: float = 5.0
    hit_rate_recovery_s: float = 10.0
    rejoin_s: float = 2.0
    hit_rate_tolerance: float = 0.1
    pre_window_s: float = 4.0
    window_s: float = 2.0
    rss_growth_kb: int = 128 * 1024
    fd_growth: int = 64
    warm_s: float = 3.0
    slack_s: float = 0.1


def route_engine(header: str) -> str:
    """The engine that served a request, from ``x-kvmesh-route`` (``served_by`` wins over ``engine``)."""
    fields = dict(part.strip().partition("=")[::2] for part in header.split(";") if "=" in part)
    return fields.get("served_by") or fields.get("engine", "")


def _in_flight(record: RequestRecord, at: float, slack: float) -> bool:
    return record.start <= at + slack and record.end >= at


def down_intervals(actions: list[FaultAction]) -> dict[str, list[tuple[float, float]]]:
    """Per engine id, when it could not serve: killed, stopped or paused until restarted or resumed."""
    out: dict[str, list[tuple[float, float]]] = {}
    open_since: dict[str, float] = {}
    for a in sorted(actions, key=lambda a: a.at):
        if not a.engine_id:
            continue
        if a.action in ENDS_PROCESS or a.action == PAUSE:
            open_since.setdefault(a.engine_id, a.at)
        elif a.action in (RESTART, RESUME) and a.engine_id in open_since:
            out.setdefault(a.engine_id, []).append((open_since.pop(a.engine_id), a.done_at))
    for engine_id, since in open_since.items():
        out.setdefault(engine_id, []).append((since, math.inf))
    return out


def all_engines_down(t: float, engine_ids: list[str], intervals: dict[str, list[tuple[float, float]]]) -> bool:
    return bool(engine_ids) and all(
        any(a <= t <= b for a, b in intervals.get(e, [])) for e in engine_ids
    )


def classify(record: RequestRecord, actions: list[FaultAction], engine_ids: list[str],
             limits: Limits = Limits()) -> str:
    """The cause of a request's outcome: ``ok``, an allowed cause, or a violation."""
    if record.ok:
        return OK
    if record.status == 429 and record.tenant == FLOOD_TENANT:
        return FLOOD_REFUSED
    router_kills = [a.at for a in actions if a.role == "router" and a.action == KILL]
    if record.status not in (0, 200):
        intervals = down_intervals(actions)
        if record.status >= 500 and any(all_engines_down(t, engine_ids, intervals) for t in (record.start, record.end)):
            return "router_error_all_engines_down"
        return f"router_error_{record.status}"
    if record.error in (TRANSPORT, INCOMPLETE):
        if any(_in_flight(record, k, limits.slack_s) for k in router_kills):
            return "reset_in_flight_on_killed_router"
        return "reset_before_first_byte" if record.first_byte is None else "reset_after_first_byte"
    if record.error == SSE_ERROR:
        engine_ends = [a.at for a in actions
                       if a.action in ENDS_PROCESS and a.engine_id and a.engine_id == record.engine]
        if any(_in_flight(record, k, limits.slack_s) for k in engine_ends):
            return "sse_error_engine_killed"
        return "sse_error_engine_alive"
    if record.error in (TIMEOUT, MALFORMED):
        return record.error
    return "other_" + (record.error or f"status_{record.status}")


def _engine_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counter increases of one engine; if any counter went down the engine restarted, and then every
    counter's value after is its increase (a per-counter guess could pair hits and queries of two lives)."""
    if any(after.get(k, 0.0) < v for k, v in before.items()):
        return dict(after)
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def window_hit_rate(samples: list[Sample], t_a: float, t_b: float) -> float:
    """Fleet hit rate (cached / queried prompt tokens) between the samples nearest inside [t_a, t_b].

    Engines missing from either end (dead, paused) contribute nothing; NaN when nothing was queried.
    """
    inside = [s for s in samples if t_a <= s.t <= t_b]
    if len(inside) < 2:
        return math.nan
    first, last = inside[0], inside[-1]
    hits = queries = 0.0
    for name, after in last.counters.items():
        before = first.counters.get(name)
        if before is None or after is None:
            continue
        d = _engine_delta(before, after)
        hits += d.get(HITS, 0.0)
        queries += d.get(QUERIES, 0.0)
    return hits / queries if queries > 0 else math.nan


def hit_rate_recovery(samples: list[Sample], pre_from: float, inject: float, heal: float, until: float,
                      limits: Limits = Limits()) -> tuple[float, float | None]:
    """(pre-fault hit rate, seconds from heal until a window's rate is back within tolerance).

    Recovery time is measured at the end of the first good window (conservative: it includes the
    window). With no pre-fault rate there is nothing to recover, so recovery is 0.
    """
    pre = window_hit_rate(samples, max(pre_from, inject - limits.pre_window_s), inject)
    if math.isnan(pre):
        return pre, 0.0
    for s in samples:
        if heal + limits.window_s <= s.t <= until:
            rate = window_hit_rate(samples, s.t - limits.window_s, s.t)
            if not math.isnan(rate) and rate >= pre - limits.hit_rate_tolerance:
                return pre, s.t - heal
    return pre, None


def convergence_time(samples: list[Sample], routers: list[str], heal: float, until: float) -> float | None:
    """Seconds from heal to the first sample where every replica answered with identical index content."""
    for s in samples:
        if heal <= s.t <= until:
            views = [s.indexes.get(r) for r in routers]
            if views and all(v is not None for v in views) and all(v == views[0] for v in views):
                return s.t - heal
    return None


def rejoin_time(records: list[RequestRecord], engine_id: str, healthy_at: float, until: float) -> float | None:
    """Seconds from an engine answering its health check again to the first request routed to it."""
    starts = [r.start for r in records if r.engine == engine_id and healthy_at <= r.start <= until]
    return min(starts) - healthy_at if starts else None


def crashes(samples: list[Sample], actions: list[FaultAction]) -> list[str]:
    """Processes seen dead that no fault action ended (killed or stopped with that pid)."""
    ended = {(a.target, a.pid) for a in actions if a.action in ENDS_PROCESS}
    seen: list[str] = []
    for s in samples:
        for name, p in s.processes.items():
            label = f"{name} (pid {p.pid})"
            if not p.alive and (name, p.pid) not in ended and label not in seen:
                seen.append(label)
    return seen


def killed_for_good(actions: list[FaultAction]) -> set[str]:
    """Processes a fault ended and nothing started again (a holder fault's router)."""
    gone: set[str] = set()
    for a in sorted(actions, key=lambda a: a.at):
        if a.action in ENDS_PROCESS and a.ok:
            gone.add(a.target)
        elif a.action == RESTART and a.ok:
            gone.discard(a.target)
    return gone


def actors(sample: Sample) -> list[str]:
    """The routers that said they act as the autoscaler in this round."""
    return sorted(name for name, view in sample.autoscaler.items() if view is not None and view.acting)


def autoscaler_checks(samples: list[Sample], actions: list[FaultAction]) -> dict[str, bool]:
    """The lease's invariants over a run, on a cluster with an autoscaler (empty without one).

    - at most one router acts in any round. A round's probes are concurrent and each is bounded by a
      second, while a holder stops acting a third of the TTL (1 s) before its lease expires and the next
      holder starts a second after the expiry at the earliest: a handover cannot look like two actors;
    - no provision made twice: the pool recorded as many provisions as distinct request ids. Ids are
      ``<provider>-<term>-<n>``, so two replicas acting for one term provision under the same ids;
    - once a holder fault has cut off and killed the holder, another router acts (some later round shows
      exactly one actor, and it is not the killed one).
    """
    if not any(s.autoscaler for s in samples):
        return {}
    pools = [s.pool for s in samples if s.pool is not None]
    checks = {
        "at_most_one_autoscaler_actor": all(len(actors(s)) <= 1 for s in samples),
        "no_provision_doubled": all(p.provisions == len(set(p.requests)) for p in pools),
    }
    holder_faults = [a for a in actions if a.fault in HOLDER_FAULTS]
    if holder_faults:
        kills = [a for a in holder_faults if a.action == KILL and a.ok]
        checks["autoscaler_acting_after_the_holder_died"] = bool(kills) and any(
            s.t > kills[-1].done_at and len(actors(s)) == 1 and actors(s) != [kills[-1].target] for s in samples)
    return checks


def survivors_alive(samples: list[Sample], routers: list[str], actions: list[FaultAction]) -> bool:
    """Every router no fault ended for good is alive in the last round."""
    if not samples:
        return False
    last = samples[-1].processes
    return all(last.get(r) is not None and last[r].alive for r in routers if r not in killed_for_good(actions))


@dataclass
class Growth:
    name: str
    pid: int
    rss_start_kb: int
    rss_end_kb: int
    fds_start: int
    fds_end: int


def resource_growth(samples: list[Sample], after: float, warm_s: float,
                    ready: dict[tuple[str, int], float] | None = None) -> list[Growth]:
    """RSS and fd count per (process, pid) from a warmed-up baseline to the last live sample.

    The baseline is the first live sample at least ``warm_s`` after the pid was first seen or, for a
    restarted one, after it became ready (and after ``after``), so start-up allocations of a restarted
    process do not count as growth.
    """
    ready = ready or {}
    first_seen: dict[tuple[str, int], float] = {}
    base: dict[tuple[str, int], tuple[int, int]] = {}
    last: dict[tuple[str, int], tuple[int, int]] = {}
    for s in samples:
        for name, p in s.processes.items():
            if not p.alive:
                continue
            key = (name, p.pid)
            first_seen.setdefault(key, s.t)
            if s.t >= max(after, max(first_seen[key], ready.get(key, 0.0)) + warm_s):
                base.setdefault(key, (p.rss_kb, p.fds))
                last[key] = (p.rss_kb, p.fds)
    return [Growth(name, pid, base[(name, pid)][0], last[(name, pid)][0], base[(name, pid)][1], last[(name, pid)][1])
            for (name, pid) in base]


@dataclass
class EventOutcome:
    """Recovery measured for one fault event; a None time means it did not recover while observed."""

    index: int
    kind: str
    target: str
    inject_at: float
    healed_at: float
    applied: bool
    observed_s: float
    convergence_s: float | None
    hit_rate_pre: float
    hit_rate_recovery_s: float | None
    rejoin_s: float | None = None


@dataclass
class Evaluation:
    invariants: dict[str, bool]
    causes: dict[str, int]
    violations: dict[str, int]
    events: list[EventOutcome]
    crashes: list[str]
    growth: list[Growth]
    undetermined: list[str] = field(default_factory=list)
    continued: list[float] = field(default_factory=list)
    """Kill-to-next-token seconds of each stream continued after its engine was killed."""


def _judge(value: float | None, limit: float, observed: float) -> bool | None:
    """True within the limit, False when it took longer (or never came within a long enough watch),
    None when the watch ended before the limit (another fault started) without a verdict."""
    if value is not None:
        return value <= limit
    return False if observed >= limit else None


def continuation_latencies(records: list[RequestRecord], actions: list[FaultAction]) -> list[float]:
    """For each stream that was under way on an engine when it was killed and still completed: seconds from
    the kill to its next token (the client's wait while the router continued it elsewhere)."""
    out = []
    for kill in (a for a in actions if a.action == KILL and a.engine_id):
        for r in records:
            if r.ok and r.stream and r.engine == kill.engine_id and r.token_times and r.token_times[0] < kill.at:
                after = next((t for t in r.token_times if t > kill.at), None)
                if after is not None:
                    out.append(after - kill.at)
    return out


def evaluate(records: list[RequestRecord], actions: list[FaultAction], samples: list[Sample],
             routers: list[str], engine_ids: list[str], run_end: float, warmup: float,
             limits: Limits = Limits(), streams_continue: bool = False, load_until: float = 0.0) -> Evaluation:
    """Check every invariant over one run. ``streams_continue``: a stream whose engine is
    killed must be finished by another engine, so no client sees a failure while an engine is alive.
    ``load_until``: extra load ran until then (the flood of a holder fault, whose long prompts evict the
    cached system prompts and dominate the token-weighted hit rate, and whose ~1,000 block events per
    prompt keep two replicas' indexes from matching at any one sampled instant while it is served): hit-rate
    recovery and convergence count from the later of the heal and it."""
    causes = Counter(classify(r, actions, engine_ids, limits) for r in records)
    allowed = ALLOWED_CAUSES - {"sse_error_engine_killed"} if streams_continue else ALLOWED_CAUSES
    violations = {c: n for c, n in causes.items() if c != OK and c not in allowed}
    by_event: dict[int, list[FaultAction]] = {}
    for a in actions:
        by_event.setdefault(a.event, []).append(a)
    order = sorted(by_event)
    outcomes: list[EventOutcome] = []
    verdicts: dict[str, list[bool | None]] = {"converge": [], "hit": [], "rejoin": []}
    undetermined: list[str] = []

    def judge(check: str, value: float | None, limit: float, outcome: EventOutcome) -> None:
        verdict = _judge(value, limit, outcome.observed_s)
        verdicts[check].append(verdict)
        if verdict is None:
            undetermined.append(f"{check}: event {outcome.index} ({outcome.kind}) watched {outcome.observed_s:.1f} s")

    previous_heal = 0.0
    live_routers = [r for r in routers if r not in killed_for_good(actions)]
    for n, ev in enumerate(order):
        acts = sorted(by_event[ev], key=lambda a: a.at)
        inject, healed = acts[0].at, max(a.done_at for a in acts)
        until = min(run_end, by_event[order[n + 1]][0].at if n + 1 < len(order) else run_end)
        quiet = max(healed, load_until)
        pre, hit_s = hit_rate_recovery(samples, previous_heal, inject, quiet, until, limits)
        outcome = EventOutcome(ev, acts[0].fault, acts[0].target, inject, healed, all(a.ok for a in acts),
                               until - healed, convergence_time(samples, live_routers, quiet, until), pre, hit_s)
        restarted = [a for a in acts if a.action == RESTART and a.engine_id]
        if restarted:
            outcome.rejoin_s = rejoin_time(records, restarted[-1].engine_id, restarted[-1].done_at, until)
            judge("rejoin", outcome.rejoin_s, limits.rejoin_s, outcome)
        judge("converge", outcome.convergence_s, limits.convergence_s, outcome)
        judge("hit", outcome.hit_rate_recovery_s, limits.hit_rate_recovery_s, outcome)
        outcomes.append(outcome)
        previous_heal = healed
    dead = crashes(samples, actions)
    ready = {(a.target, a.pid): a.done_at for a in actions if a.action == RESTART}
    growth = resource_growth(samples, warmup, limits.warm_s, ready)
    invariants = {
        "no_request_failed_outside_killed_router": not any(c.startswith("reset_") for c in violations),
        "no_engine_fault_leaked_before_first_byte": not any(c.startswith("router_error_") for c in violations),
        "mid_stream_errors_only_from_killed_engines": "sse_error_engine_alive" not in violations,
        "no_other_request_failures": not any(c.startswith(("timeout", "malformed", "other_")) for c in violations),
        "every_fault_applied": all(o.applied for o in outcomes),
        "indexes_converged_within_5s": all(v is not False for v in verdicts["converge"]),
        "hit_rate_recovered_within_10s": all(v is not False for v in verdicts["hit"]),
        "restarted_engines_routed_within_2s": all(v is not False for v in verdicts["rejoin"]),
        "no_unexpected_process_exit": not dead,
        "rss_growth_bounded": all(g.rss_end_kb - g.rss_start_kb <= limits.rss_growth_kb for g in growth),
        "fd_growth_bounded": all(g.fds_end - g.fds_start <= limits.fd_growth for g in growth),
        "requests_were_served": causes.get(OK, 0) > 0,
        "surviving_routers_alive_at_the_end": survivors_alive(samples, routers, actions),
        **autoscaler_checks(samples, actions),
    }
    if streams_continue:
        invariants["no_client_visible_failure_while_an_engine_lives"] = not violations
    if any(a.fault in HOLDER_FAULTS for a in actions):
        invariants["no_failure_a_live_engine_could_have_served"] = not violations
    return Evaluation(invariants, dict(causes), violations, outcomes, dead, growth, undetermined,
                      continuation_latencies(records, actions))
