"""Rendezvous ownership: deterministic, balanced enough, and minimal movement on membership change."""

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from mesh.ownership import owned_engines, owners

ids = st.text("abcdefgh0123456789", min_size=1, max_size=6)


@given(st.sets(ids, min_size=1, max_size=8), ids, st.integers(1, 4))
def test_owners_are_distinct_live_members_and_order_independent(members, engine, redundancy):
    result = owners(engine, members, redundancy)
    assert len(result) == min(redundancy, len(members))
    assert len(set(result)) == len(result) and set(result) <= members
    assert owners(engine, sorted(members, reverse=True), redundancy) == result


@given(st.sets(ids, min_size=2, max_size=8), st.lists(ids, min_size=1, max_size=30), st.data())
def test_removing_a_member_moves_only_its_engines_to_the_next_in_order(members, engines, data):
    gone = data.draw(st.sampled_from(sorted(members)))
    rest = members - {gone}
    for engine in engines:
        before = owners(engine, members, 2)
        after = owners(engine, rest, 2)
        if gone not in before:
            assert after == before
        else:
            assert after[: len(before) - 1] == [m for m in before if m != gone]
            assert after == [m for m in owners(engine, members, 3) if m != gone][:2]


def test_load_spreads_across_members():
    members = [f"router-{i}" for i in range(4)]
    engines = [f"engine-{i}" for i in range(400)]
    primaries = Counter(owners(e, members, 1)[0] for e in engines)
    assert set(primaries) == set(members)
    assert min(primaries.values()) > 60


def test_owned_engines_matches_owners():
    members = ["a", "b", "c"]
    engines = [f"e{i}" for i in range(20)]
    for m in members:
        assert owned_engines(m, engines, members) == {e for e in engines if m in owners(e, members)}
