"""The lease: renewal, takeover once expired, quorum against the membership (never a sliding window),
acting only with time to spare, settling, the member list, malformed values."""

from autoscale.lease import Lease, LeaseKeeper, parse_members

ALL = frozenset({"a", "b", "c"})


def test_first_claim_goes_to_the_lowest_alive_replica():
    assert LeaseKeeper("a").claim(None, 0, ALL, ALL) == Lease("a", 3.0, 1)
    assert LeaseKeeper("b").claim(None, 0, ALL, ALL) is None


def test_holder_renews_before_expiry_others_leave_it():
    keeper = LeaseKeeper("b")
    lease = Lease("b", 3.0, 4)
    assert keeper.claim(lease, 0.5, ALL, ALL) is None
    assert keeper.claim(lease, 2.0, ALL, ALL) == Lease("b", 5.0, 4)
    assert LeaseKeeper("a").claim(lease, 2.0, ALL, ALL) is None


def test_a_holder_that_looks_dead_keeps_its_lease_until_it_expires():
    lease = Lease("a", 10.0, 2)
    survivors = {"b", "c"}
    # a partitioned holder looks exactly like a dead one, and may still act until 10.0 - margin
    assert LeaseKeeper("b").claim(lease, 1.0, survivors, ALL) is None
    assert LeaseKeeper("b").claim(lease, 10.0, survivors, ALL) == Lease("b", 13.0, 3)
    assert LeaseKeeper("c").claim(lease, 10.0, survivors, ALL) is None


def test_the_holder_stops_acting_a_third_of_the_ttl_before_anyone_may_claim():
    keeper = LeaseKeeper("a", settle_s=0)
    lease = Lease("a", 3.0, 1)
    assert keeper.acting(lease, 0.0, ALL, ALL)
    assert keeper.acting(lease, 1.9, ALL, ALL)
    assert not keeper.acting(lease, 2.0, ALL, ALL)  # a stalled loop wakes up here: too late to act


def test_a_minority_never_regains_quorum_however_long_the_partition_lasts():
    """The old rule counted quorum against the replicas seen in the last minute: 61 s into a partition the
    lone replica was its own majority and claimed the lease next to the majority's holder."""
    keeper = LeaseKeeper("a", settle_s=0)
    lease = Lease("a", 3.0, 1)
    assert keeper.acting(lease, 0.1, ALL, ALL)
    for t in range(1, 600):
        assert keeper.claim(lease if t < 3 else None, float(t), {"a"}, ALL) is None
        assert not keeper.acting(Lease("a", t + 3.0, 1), float(t), {"a"}, ALL)
    majority = LeaseKeeper("b", settle_s=0)
    assert majority.claim(lease, 3.0, {"b", "c"}, ALL) == Lease("b", 6.0, 2)


def test_a_configured_mesh_size_overrides_the_member_list():
    keeper = LeaseKeeper("a", replicas=3)
    assert keeper.claim(None, 0, {"a"}, frozenset()) is None
    assert keeper.claim(None, 0, {"a", "x"}, frozenset()) == Lease("a", 3.0, 1)


def test_a_replica_that_starts_alone_waits_before_it_claims():
    keeper = LeaseKeeper("a", join_s=10.0, started_at=100.0)
    assert keeper.claim(None, 100.0, {"a"}, frozenset()) is None
    assert keeper.claim(None, 109.0, {"a"}, frozenset()) is None
    assert keeper.claim(None, 110.0, {"a"}, frozenset()) == Lease("a", 113.0, 1)
    # with a member list in the document (a mesh that ran before), alone is never enough
    assert LeaseKeeper("a", started_at=0.0).claim(None, 500.0, {"a"}, ALL) is None


def test_new_holder_waits_to_settle_before_acting():
    keeper = LeaseKeeper("a", settle_s=1.0)
    lease = keeper.claim(None, 0, ALL, ALL)
    assert not keeper.acting(lease, 0.0, ALL, ALL)
    assert not keeper.acting(lease, 0.5, ALL, ALL)
    assert keeper.acting(lease, 1.0, ALL, ALL)
    assert not keeper.acting(lease, 1.0, ALL, ALL, isolated=True)
    assert not keeper.acting(Lease("b", 9, 2), 1.5, ALL, ALL)


def test_the_member_list_changes_one_member_at_a_time():
    keeper = LeaseKeeper("a", forget_s=60.0)
    assert keeper.members_update(0.0, {"a", "b"}, frozenset(), set()) == ["a", "b"]
    assert keeper.members_update(1.0, {"a", "b", "c", "d"}, {"a", "b"}, set()) == ["a", "b", "c"]
    assert keeper.members_update(2.0, {"a", "b", "c", "d"}, {"a", "b", "c"}, set()) == ["a", "b", "c", "d"]
    assert keeper.members_update(3.0, {"a", "b", "c", "d"}, {"a", "b", "c", "d"}, set()) is None
    # d crashed: forgotten 60 s after it was last seen alive; c left gracefully: at once
    assert keeper.members_update(30.0, {"a", "b", "c"}, {"a", "b", "c", "d"}, set()) is None
    assert keeper.members_update(64.0, {"a", "b", "c"}, {"a", "b", "c", "d"}, set()) == ["a", "b", "c"]
    assert keeper.members_update(65.0, {"a", "b"}, {"a", "b", "c"}, {"c"}) == ["a", "b"]
    assert LeaseKeeper("a", replicas=3).members_update(0.0, ALL, frozenset(), set()) is None


def test_malformed_lease_and_members_are_free():
    assert Lease.from_json("{") is None and Lease.from_json('{"holder": "a"}') is None
    assert Lease.from_json('{"holder": "a", "expires_at": 1e999, "term": -1}') is None
    assert Lease.from_json("[" * 100_000 + "]" * 100_000) is None
    assert Lease.from_json(Lease("a", 1.5, 2).to_json()) == Lease("a", 1.5, 2)
    assert parse_members('["a", 1]') == frozenset() and parse_members("[" * 100_000) == frozenset()
    assert parse_members('["b", "a"]') == {"a", "b"}
