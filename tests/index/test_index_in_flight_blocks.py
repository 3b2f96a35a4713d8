"""The blocks requests in flight hold per engine: distinct chain blocks plus private ones, and the leading blocks a
new chain shares with them, against a brute-force union (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from index.in_flight_blocks import InFlightBlocks

BASES = [[base * 1000 + i for i in range(40)] for base in range(3)]
"""Three prompts' chains: a request's chain is a prefix of one of them (chains are prefix-closed)."""


def union_prefix(chain: list[int], live: list[tuple[str, list[int], int]], engine: str) -> int:
    held = {key for e, keys, _ in live if e == engine for key in keys}
    n = 0
    while n < len(chain) and chain[n] in held:
        n += 1
    return n


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from(["a", "b"]), st.integers(0, 2), st.integers(0, 40),
                          st.integers(0, 9)), max_size=40),
       st.integers(0, 2), st.integers(0, 40))
def test_held_and_shared_match_the_union_of_live_claims(steps, probe_base, probe_length):
    busy = InFlightBlocks()
    live, claims = [], []
    for release, engine, base, length, private in steps:
        if release and claims:
            claim = claims.pop(0)
            live.pop(0)
            busy.release(claim)
        else:
            chain = BASES[base][:length]
            claims.append(busy.add(engine, chain, private))
            live.append((engine, chain, private))
    probe = BASES[probe_base][:probe_length]
    for engine in ("a", "b"):
        keys = {key for e, chain, _ in live if e == engine for key in chain}
        assert busy.held(engine) == len(keys) + sum(p for e, _, p in live if e == engine)
        assert busy.shared(engine, probe) == union_prefix(probe, live, engine)
    for claim in claims:
        busy.release(claim)
    assert busy.held("a") == busy.held("b") == 0 and busy.shared("a", BASES[0]) == 0
