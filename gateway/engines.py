"""What one router knows about each engine: identity, served models, load, health, and its pool.

Pollers and the proxy write here; the routing core reads an immutable ``EngineView`` built per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

import trio

from gateway.breaker import EngineHealth
from gateway.config import EngineConfig, validate_engine_url
from gateway.first_tokens import PendingFirstTokens
from gateway.upstream import Connect, EnginePool


@dataclass
class PrefixReuse:
    """The engine's recent prefix-cache hit ratio, from its cumulative query and hit counters.

    Each poll's increments are added to sums that fade by ``fade`` per poll, so the ratio follows the last
    dozen polls; a counter going backwards (restart) only resets the baseline.
    """

    fade: float = 0.8
    ratio: float = 0.0
    _last: tuple[float, float] | None = None
    _queries: float = 0.0
    _hits: float = 0.0

    @property
    def measured(self) -> bool:
        """Whether any query was counted yet (a fresh engine's ratio of 0 means nothing)."""
        return self._queries > 0

    def record(self, queries: float, hits: float) -> None:
        last, self._last = self._last, (queries, hits)
        if last is None or queries < last[0] or hits < last[1]:
            return
        self._queries = self.fade * self._queries + (queries - last[0])
        self._hits = self.fade * self._hits + (hits - last[1])
        if self._queries > 0:
            self.ratio = min(1.0, self._hits / self._queries)


@dataclass
class EngineLoad:
    """The engine's own view of its load, from its /metrics (may be up to one poll interval old)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_blocks: int | None = None
    block_size: int | None = None
    polled_at: float | None = None
    poll_generation: int = 0
    finished_since_poll: int = 0
    """This router's requests to the engine that ended after the last poll (still counted as running)."""
    reuse: PrefixReuse = field(default_factory=PrefixReuse)
    max_lora: int | None = None
    """LoRA slots, for an engine reporting ``vllm:lora_requests_info``."""
    running_adapters: frozenset[str] = frozenset()


@dataclass
class EngineState:
    id: str
    config: EngineConfig
    pool: EnginePool
    models: set[str] = field(default_factory=set)
    load: EngineLoad = field(default_factory=EngineLoad)
    in_flight: int = 0
    rejoining: bool = False
    health: EngineHealth = field(default_factory=EngineHealth)
    draining: bool = False
    maintenance: bool = False
    zone: str | None = None
    event_sources: list[str] = field(default_factory=list)
    reported_role: str | None = None
    reported_protocol: str | None = None
    """What the engine's /server_info says (vLLM's development mode only); the config's values win."""
    dp_ranks: tuple[int, ...] = ()
    """The data-parallel ranks of its event sources (vLLM lists one per rank), in order; () when unknown."""
    max_model_len: int | None = None
    """The context length the engine reports in ``/v1/models`` (vLLM does), if any."""
    adapters: dict[str, str] = field(default_factory=dict)
    """LoRA adapters the engine serves (listed in ``models`` too) -> their base model."""
    first_tokens: PendingFirstTokens = field(default_factory=PendingFirstTokens)
    """Streams sent to it whose first token has not reached the client (its event ingest lets them go first)."""

    @property
    def role(self) -> str:
        return self.config.role or self.reported_role or "both"

    @property
    def kv_protocol(self) -> str:
        return self.config.kv_protocol or self.reported_protocol or "handoff"

    @property
    def url(self) -> str:
        return self.config.url.rstrip("/")

    @property
    def healthy(self) -> bool:
        """Health polls, request outcomes (circuit breaker) and metric polls combined, as of the loop's clock;
        a read that changes nothing."""
        return self.health.routable(trio.current_time())

    @property
    def routable(self) -> bool:
        """Takes traffic: healthy, in rotation, and its models are known (discovered or configured), so a
        router is not ready before it could answer a request for them."""
        known = bool(self.models) or self.config.model is not None
        return known and self.healthy and not self.draining and not self.maintenance

    @property
    def block_size(self) -> int:
        return self.config.block_size or self.load.block_size or 16

    def serves(self, model: str) -> bool:
        return model in self.models or (not self.models and self.config.model == model)


class InFlight:
    """One attempt's share of its engine's ``in_flight`` (what peers and autoscaler drains see), given back
    exactly once by whoever ends the attempt first: a continued stream gives its broken engine's share back
    at the break, the attempt's owner at its end, a cancellation (the client left) on its way out."""

    __slots__ = ("_generation", "_held", "engine")

    def __init__(self, engine: EngineState) -> None:
        self.engine = engine
        self._generation = engine.load.poll_generation
        self._held = True
        engine.in_flight += 1

    def release(self) -> None:
        if self._held:
            self._held = False
            self.engine.in_flight -= 1
            if self.engine.load.poll_generation != self._generation:
                self.engine.load.finished_since_poll += 1


def engine_id_for(config: EngineConfig) -> str:
    """A readable, stable id: the configured one, else host:port of the URL."""
    if config.id:
        return config.id
    parts = urlsplit(config.url)
    return f"{parts.hostname}:{parts.port or 80}"


class EngineRegistry:
    def __init__(self, connect: Connect | None = None) -> None:
        """``connect``: how the engines' pools open connections (TCP, or TLS for https, when None)."""
        self._engines: dict[str, EngineState] = {}
        self._connect = connect

    def add(self, config: EngineConfig) -> EngineState:
        """Register an engine; ValueError if its URL is not one the pool can use (whatever the source:
        config, admin API or the replicated registry)."""
        validate_engine_url(config.url)
        engine_id = engine_id_for(config)
        if engine_id in self._engines:
            return self._engines[engine_id]
        state = EngineState(engine_id, config, EnginePool(config.url, connect=self._connect))
        if config.model:
            state.models.add(config.model)
        self._engines[engine_id] = state
        return state

    def remove(self, engine_id: str) -> EngineState | None:
        return self._engines.pop(engine_id, None)

    def get(self, engine_id: str) -> EngineState | None:
        return self._engines.get(engine_id)

    def all(self) -> list[EngineState]:
        return list(self._engines.values())

    def for_model(self, model: str) -> list[EngineState]:
        return [e for e in self._engines.values() if e.serves(model)]

    def models(self) -> list[str]:
        return sorted({m for e in self._engines.values() for m in e.models})
