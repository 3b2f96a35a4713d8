"""Per-tenant limits: locally exact, cluster-wide within the documented slack, 1/N when peers go stale."""

import copy
import json
import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.config import AdmissionConfig
from gateway.admission.decision import Admit, Reject
from gateway.admission.ratelimit import RateLimiter
from gateway.security.auth import Tenant

CONFIG = AdmissionConfig()
W = CONFIG.request_window_s


def tenant(rps: float | None = 5.0, tpm: float | None = None) -> Tenant:
    return Tenant("acme", requests_per_second=rps, prompt_tokens_per_minute=tpm)


def sync(replicas: list[RateLimiter], now: float) -> None:
    """What the mesh does: every replica's export lands (as JSON) in every other replica."""
    payloads = {r.replica_id: json.loads(json.dumps(r.export(now))) for r in replicas}
    for r in replicas:
        for replica_id, payload in payloads.items():
            r.merge_peer_counts(replica_id, payload, now)


def offer(limiter: RateLimiter, t: Tenant, start: float, end: float, per_s: float) -> int:
    n, admitted = int((end - start) * per_s), 0
    for k in range(n):
        admitted += isinstance(limiter.admit(t, start + k / per_s), Admit)
    return admitted


def test_unlimited_tenant_is_always_admitted():
    limiter = RateLimiter("r1")
    assert all(isinstance(limiter.admit(tenant(None), 0.0, 10**9), Admit) for _ in range(100))


def test_single_replica_burst_then_rate_with_retry_after():
    limiter = RateLimiter("r1")
    decisions = [limiter.admit(tenant(), 100.0) for _ in range(6)]
    assert all(isinstance(d, Admit) for d in decisions[:5])
    assert isinstance(decisions[5], Reject) and abs(decisions[5].retry_after_s - 0.2) < 1e-9
    assert decisions[5].error().status == 429 and decisions[5].error().headers()[-1] == (b"retry-after", b"1")
    assert isinstance(limiter.admit(tenant(), 100.2 + 1e-6), Admit)


def test_request_larger_than_the_token_budget_is_refused_without_retry_after():
    limiter = RateLimiter("r1")
    decision = limiter.admit(tenant(rps=None, tpm=1000), 0.0, prompt_tokens=1001)
    assert isinstance(decision, Reject) and decision.retry_after_s is None
    assert decision.error().headers() == [(b"content-type", b"application/json")]
    assert isinstance(limiter.admit(tenant(rps=None, tpm=1000), 0.0, prompt_tokens=1000), Admit)


def test_a_reject_charges_nothing():
    limiter = RateLimiter("r1")
    t = tenant(rps=5.0, tpm=600)
    assert isinstance(limiter.admit(t, 0.0, prompt_tokens=600), Admit)
    assert all(isinstance(limiter.admit(t, 0.0, prompt_tokens=50), Reject) for _ in range(10))
    assert sum(limiter.export(0.0)["tenants"]["acme"]["req"]["counts"]) == 1


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 4), st.sampled_from([2.0, 5.0, 10.0]), st.sampled_from([0.1, 0.25, 0.5]),
       st.floats(1.0, 4.0), st.integers(0, 2**32))
def test_cluster_total_stays_within_limit_plus_documented_slack(n, rps, lag, overload, seed):
    rng = random.Random(seed)
    replicas = [RateLimiter(f"r{i}") for i in range(n)]
    t = tenant(rps)
    admitted: Counter[int] = Counter()
    now, next_sync, duration = 0.0, 0.0, 3 * W
    while now < duration:
        while next_sync <= now:
            sync(replicas, next_sync)
            next_sync += lag
        if isinstance(rng.choice(replicas).admit(t, now), Admit):
            admitted[int(now)] += 1
        now += rng.expovariate(rps * overload)
    burst = max(1.0, rps * CONFIG.request_burst_s)
    slack = (n - 1) * (rps * lag + burst)
    slots = CONFIG.request_slots
    for first in range(int(duration) + 1):
        total = sum(admitted[s] for s in range(first, first + slots))
        assert total <= rps * W + slack


def test_cluster_shares_one_budget_and_still_uses_it():
    replicas = [RateLimiter(f"r{i}") for i in range(3)]
    t = tenant(5.0)
    admitted: Counter[int] = Counter()
    for k in range(3000):
        now = k * 0.01
        if k % 25 == 0:
            sync(replicas, now)
        admitted[int(now)] += isinstance(replicas[k % 3].admit(t, now), Admit)
    windows = [sum(admitted[s] for s in range(first, first + 10)) for first in range(21)]
    slack = 2 * (5 * 0.25 + 5)
    assert max(windows) <= 50 + slack
    assert min(windows) >= 40


def test_stale_peer_leaves_half_and_a_forgotten_peer_returns_it():
    a, b = RateLimiter("a"), RateLimiter("b")
    a.merge_peer_counts("b", b.export(0.0), 0.0)
    t = tenant(5.0)
    assert 23 <= offer(a, t, 10.0, 20.0, 20) <= 25
    assert 48 <= offer(a, t, 40.0, 50.0, 20) <= 50


def test_forget_peer_returns_its_share_at_once():
    a, b = RateLimiter("a"), RateLimiter("b")
    t = tenant(5.0)
    a.merge_peer_counts("b", b.export(0.0), 0.0)
    assert offer(a, t, 1.0, 2.0, 20) <= 25
    before = copy.deepcopy(a)
    a.forget_peer("b")
    assert offer(before, t, 2.0, 2.5, 10) <= offer(a, t, 2.0, 2.5, 10)


def test_peer_counts_reduce_the_local_allowance():
    a, b = RateLimiter("a"), RateLimiter("b")
    t = tenant(5.0)
    used_by_b = offer(b, t, 0.0, 8.0, 10)
    assert 40 <= used_by_b <= 45
    a.merge_peer_counts("b", json.loads(json.dumps(b.export(8.0))), 8.0)
    assert offer(a, t, 8.0, 9.0, 20) == 50 - used_by_b
    decision = a.admit(t, 9.0)
    assert isinstance(decision, Reject) and decision.retry_after_s == 1.0


def test_own_and_older_payloads_are_ignored():
    a, b = RateLimiter("a"), RateLimiter("b")
    assert not a.merge_peer_counts("a", a.export(0.0), 0.0)
    assert a.merge_peer_counts("b", b.export(5.0), 5.0)
    assert not a.merge_peer_counts("b", b.export(4.0), 5.0)
    assert a.malformed == 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)
good = RateLimiter("x").export(0.0)
near_good = st.fixed_dictionaries({
    "v": st.sampled_from([1, 2, "1"]), "at": st.floats() | st.integers(), "windows": st.just(good["windows"]),
    "tenants": st.dictionaries(st.text(max_size=4), st.dictionaries(st.sampled_from(["req", "tok", "x"]),
                               st.fixed_dictionaries({"first": json_values | st.integers(),
                                                      "counts": st.lists(st.floats() | st.integers(-3, 9))})),
                               max_size=3),
})


@given(st.one_of(json_values, near_good))
def test_malformed_payloads_are_counted_and_dropped(payload):
    limiter = RateLimiter("a")
    used = limiter.merge_peer_counts("b", payload, 0.0)
    assert used or limiter.malformed == 1
    assert isinstance(limiter.admit(tenant(), 0.0), Admit | Reject)
