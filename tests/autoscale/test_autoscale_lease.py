"""The lease: renewal, takeover when the holder dies or expires, quorum, settling, malformed values."""

from autoscale.lease import Lease, LeaseKeeper

ALL = {"a", "b", "c"}


def test_first_claim_goes_to_the_lowest_alive_replica():
    assert LeaseKeeper("a").claim(None, 0, ALL, ALL) == Lease("a", 3.0, 1)
    assert LeaseKeeper("b").claim(None, 0, ALL, ALL) is None


def test_holder_renews_before_expiry_others_leave_it():
    keeper = LeaseKeeper("b")
    lease = Lease("b", 3.0, 4)
    assert keeper.claim(lease, 0.5, ALL, ALL) is None
    assert keeper.claim(lease, 2.0, ALL, ALL) == Lease("b", 5.0, 4)
    assert LeaseKeeper("a").claim(lease, 2.0, ALL, ALL) is None


def test_dead_holder_is_replaced_by_the_next_lowest_with_a_new_term():
    lease = Lease("a", 10.0, 2)
    survivors = {"b", "c"}
    assert LeaseKeeper("b").claim(lease, 1.0, survivors, survivors) == Lease("b", 4.0, 3)
    assert LeaseKeeper("c").claim(lease, 1.0, survivors, survivors) is None
    # still listed as live (suspected) but its lease lapsed: taken anyway
    assert LeaseKeeper("b").claim(lease, 11.0, ALL, survivors) == Lease("b", 14.0, 3)


def test_minority_side_neither_renews_nor_acts():
    keeper = LeaseKeeper("a", settle_s=0)
    lease = Lease("a", 3.0, 1)
    keeper.claim(lease, 0.0, ALL, ALL)
    assert keeper.acting(lease, 0.1)
    assert keeper.claim(lease, 2.5, {"a"}, {"a"}) is None
    assert not keeper.acting(lease, 2.6)


def test_new_holder_waits_to_settle_before_acting():
    keeper = LeaseKeeper("a", settle_s=1.0)
    lease = keeper.claim(None, 0, ALL, ALL)
    assert not keeper.acting(lease, 0.0)
    assert not keeper.acting(lease, 0.5)
    assert keeper.acting(lease, 1.0)
    assert not keeper.acting(lease, 1.0, isolated=True)
    assert not keeper.acting(Lease("b", 9, 2), 1.5)


def test_malformed_lease_is_free():
    assert Lease.from_json("{") is None and Lease.from_json('{"holder": "a"}') is None
    assert Lease.from_json(Lease("a", 1.5, 2).to_json()) == Lease("a", 1.5, 2)
