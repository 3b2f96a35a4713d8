"""The values that cross the boundary between the router's I/O edge and the sans-IO routing core.

The edge builds one immutable ``EngineView`` per engine and one ``RouteRequest`` per request; a policy
answers with a ``Decision``. Nothing here holds a socket, a clock or a lock, so decisions can be
replayed and property-tested.

The two made once per engine per decision (``EngineView``, ``CandidateScore``) are frozen msgspec structs,
not frozen dataclasses: a frozen dataclass sets each of its ~25 fields through ``object.__setattr__``, and
at 15-64 engines building, pricing and copying them was a fifth of a decision.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


class EngineView(msgspec.Struct, frozen=True, gc=False):
    """One engine as the router sees it at decision time.

    ``in_flight`` is this router's own outstanding requests (fresh); ``peer_in_flight`` the other mesh
    replicas', as they reported them (a tenth of a second old); ``running``/``waiting``/``kv_usage``
    come from the engine's /metrics poll (all routers' traffic, possibly one poll old).
    ``exact_blocks`` are leading prompt blocks confirmed by the engine's KV events; ``approx_blocks`` are
    leading blocks from speculative entries (where routers recently sent the prefix, not yet confirmed).
    ``confidence`` (0..1) is how far the index's knowledge of this engine is trusted.
    ``finished_since_poll`` counts this router's requests that the last poll saw on the engine and that have
    finished since: the poll still counts them in ``running``. A chat's next turn arrives right after its
    previous turn ends, so without this its own finished turn makes the engine holding its cache look busier.
    """

    id: str
    url: str
    island: str | None = None
    healthy: bool = True
    draining: bool = False
    in_flight: int = 0
    peer_in_flight: int = 0
    running: int = 0
    finished_since_poll: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_blocks: int | None = None
    block_size: int = 16
    exact_blocks: int = 0
    approx_blocks: int = 0
    confidence: float = 1.0
    held_blocks: int | None = None
    """Blocks the engine caches according to its KV events, or to the router's record for an engine without
    events (None: not known)."""
    approx_held_blocks: int | None = None
    """Blocks the router's own record says the engine caches (what it sent there, bounded by capacity)."""
    reuse_ratio: float = 0.0
    """Share of recently queried prompt tokens the engine served from its prefix cache (its own counters)."""
    busy_blocks: int = 0
    """Blocks this router's requests in flight there will hold until they finish: their prompts' distinct blocks
    and their expected answers' (index/in_flight_blocks.py)."""
    busy_shared_blocks: int = 0
    """Of the request's own prompt blocks, the leading ones those requests already hold."""
    stream_remaining_s: tuple[float, ...] = ()
    """Seconds each of this router's streams in flight there is still expected to run
    (gateway/routing/stream_ends.py)."""
    max_num_seqs: int | None = None
    rejoining: bool = False
    """Back from being down and not yet served again by this router (see KvAwarePolicy's rejoin probe)."""
    adapter_load_s: float = 0.0
    """Loading the request's LoRA adapter into one of the engine's slots: none where it is running already."""
    adapter_slots_full: bool = False
    """The adapter is not running there and every LoRA slot is held by other adapters' requests."""
    tier_runs: tuple[tuple[str, int, float], ...] = ()
    """Prompt blocks right after ``exact_blocks`` that the engine's offloaded tiers hold, as runs of
    (medium, blocks, seconds to load one block): credited as cached, charged their load time."""

    @property
    def live(self) -> bool:
        """An engine that may take new work: healthy and not being drained."""
        return self.healthy and not self.draining


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What routing needs to know about one request (the body itself never reaches the core).

    ``total_blocks`` is the prompt's count of full blocks; overlaps are converted to tokens per engine
    (``blocks * engine.block_size``) so engines with different block sizes compare fairly.
    """

    model: str
    prompt_tokens: int
    total_blocks: int = 0
    prefix_key: str = ""
    session_key: str | None = None
    router_island: str | None = None
    max_tokens: int | None = None
    home_key: str = ""
    """Names the prompt's leading blocks (see gateway/routing/homes.py); empty: the prompt has no full block."""


class CandidateScore(msgspec.Struct, frozen=True, gc=False):
    """The cost model's estimate for one candidate; a row of the explanation table.

    ``queue_depth`` and ``uncached_tokens`` are the values to hand back to ``Policy.observe`` with the
    measured TTFT once the first token of a request sent to this engine arrives.
    """

    engine: str
    exact_tokens: int
    approx_tokens: int
    cached_tokens: float
    uncached_tokens: int
    confidence: float
    queue_depth: int
    queue_s: float
    prefill_s: float
    pressure_penalty_s: float
    topology_penalty_s: float
    live: bool = True
    decode_s: float = 0.0
    eviction_s: float = 0.0
    """Expected recompute, by later requests, of the cached blocks this placement pushes out (not a delay
    of this request, so outside ``ttft_s`` and ``done_s``)."""
    home: bool = False
    """The engine is one of the prompt's homes (gateway/routing/homes.py)."""
    displacement_s: float = 0.0
    """Expected recompute of the other prefixes' homes this placement pushes out of the engine's cache."""
    crowding_s: float = 0.0
    """For a prefix without a home: the queueing its later requests meet beside the traffic homed there."""
    stall_s: float = 0.0
    """How much this request's prefill delays the streams decoding on the engine (see ``CostModel.stall_s``)."""
    overflow_s: float = 0.0
    """For a conversation's next turn: its prompt's recompute when the engine cannot keep its conversations'
    histories until their next turns (gateway/routing/sessions.py)."""
    tier_runs: tuple[tuple[str, int, float], ...] = ()
    """The engine's lower-tier runs after its GPU prefix (``EngineView.tier_runs``) when they were credited."""
    tier_tokens: int = 0
    """Prompt tokens those runs hold (beyond ``exact_tokens``, the GPU's)."""
    load_s: float = 0.0
    """Loading those runs back into the engine's KV cache; part of ``prefill_s``."""
    adapter_s: float = 0.0
    """Loading the request's LoRA adapter there, and waiting for a slot when all are taken; in ``queue_s``."""

    @property
    def penalties_s(self) -> float:
        return self.pressure_penalty_s + self.topology_penalty_s

    @property
    def ttft_s(self) -> float:
        """Estimated time to first token: queue + prefill of the uncached suffix + penalties."""
        return self.queue_s + self.prefill_s + self.penalties_s

    @property
    def done_s(self) -> float:
        """Estimated time to the last token: the first token plus this request's own decoding there."""
        return self.ttft_s + self.decode_s

    @property
    def cost_s(self) -> float:
        """What ranking minimises: this request's time to its last token plus what it costs other ones.

        ``done_s`` spelled out, added in the same order (so the same float): a decision reads this three times per
        engine, and with the three nested properties it was about 6% of ``kvmesh bench decide`` at 256 engines under
        cProfile."""
        return (self.queue_s + self.prefill_s + (self.pressure_penalty_s + self.topology_penalty_s) + self.decode_s
                + self.eviction_s + self.displacement_s + self.crowding_s + self.stall_s + self.overflow_s)

    @property
    def overlap_tokens(self) -> int:
        """Leading prompt tokens the router believes the engine holds, by either kind of knowledge (its
        offloaded tiers included)."""
        return max(self.exact_tokens + self.tier_tokens, self.approx_tokens)


@dataclass(frozen=True, slots=True)
class HomeNote:
    """Where the prompt's prefix lives and, when the chosen engine is not one of its homes, why it left."""

    key: str
    blocks: int
    homes: tuple[str, ...]
    heat: float
    capacity_blocks: dict[str, int | None]
    left_because: str | None = None
    session: str = ""
    """The conversation the request continues or starts: a digest of its ``prefix_key``
    (``gateway/routing/kv_aware.py`` ``session_of``)."""
    shared_blocks: int = 0
    """Prompt blocks the first-ranked engine held of it already (a failover engine's are not known)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """A ranked answer: the proxy tries ``ranked`` in order, failing over before the first byte."""

    ranked: list[str]
    table: list[CandidateScore]
    reason: str
    policy: str
    prompt_tokens: int = 0
    home: HomeNote | None = None

    @property
    def chosen(self) -> str | None:
        return self.ranked[0] if self.ranked else None
