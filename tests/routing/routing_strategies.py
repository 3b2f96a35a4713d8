"""Hypothesis strategies shared by the routing tests (imported by file name from this folder)."""

from __future__ import annotations

from hypothesis import strategies as st

from gateway.routing import EngineView, RouteRequest

ISLANDS = st.sampled_from([None, "east", "west"])


@st.composite
def engine_views(draw: st.DrawFn, engine_id: str) -> EngineView:
    block_size = draw(st.sampled_from([16, 32, 128]))
    exact = draw(st.integers(0, 300))
    return EngineView(
        id=engine_id,
        url=f"http://127.0.0.1:1/{engine_id}",
        island=draw(ISLANDS),
        healthy=draw(st.booleans()),
        draining=draw(st.booleans()),
        in_flight=draw(st.integers(0, 40)),
        running=draw(st.integers(0, 40)),
        finished_since_poll=draw(st.integers(0, 4)),
        waiting=draw(st.integers(0, 20)),
        kv_usage=draw(st.floats(0.0, 1.0)),
        num_blocks=draw(st.one_of(st.none(), st.integers(1, 4000))),
        block_size=block_size,
        exact_blocks=exact,
        approx_blocks=exact + draw(st.integers(0, 100)),
        confidence=draw(st.floats(0.0, 1.0)),
        max_num_seqs=draw(st.one_of(st.none(), st.integers(1, 64))),
    )


@st.composite
def fleets(draw: st.DrawFn, min_size: int = 1, max_size: int = 6) -> list[EngineView]:
    n = draw(st.integers(min_size, max_size))
    return [draw(engine_views(f"e{i}")) for i in range(n)]


@st.composite
def requests(draw: st.DrawFn) -> RouteRequest:
    prompt = draw(st.integers(0, 4096))
    return RouteRequest(
        model="m",
        prompt_tokens=prompt,
        total_blocks=prompt // 16,
        prefix_key=draw(st.text(max_size=20)),
        session_key=draw(st.one_of(st.none(), st.text(min_size=1, max_size=10))),
        router_island=draw(ISLANDS),
        max_tokens=draw(st.one_of(st.none(), st.integers(0, 1024))),
    )
