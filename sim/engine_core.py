"""Continuous-batching scheduler of one simulated engine (sans-IO, deterministic).

Follows vLLM v1's scheduler closely enough for a router to see the same behaviour: running
requests are served first (decode 1 token, or the next prefill chunk), then waiting requests are
admitted FCFS while there are free sequence slots, token budget and KV blocks; a running request
that needs a block when none is free preempts the most recently admitted one (its blocks are
freed, it goes back to the head of the queue and is recomputed later, usually from cache).
Blocks are cached when the step that computes them is scheduled, as vLLM's ``KVCacheManager.allocate_slots``
caches every block the step will fill: a request admitted later in the same step already hits the blocks an
earlier one is computing (both are computed in one forward pass, each layer's KV written before attention reads
it). Blocks completed by generated tokens are cached the same way. Their BlockStored events are published after
the step, with the batch (vLLM publishes the events it queued when it processes the step's output).
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from index.media_keys import MediaSpan, block_media
from index.vllm_hash import BlockHasher, salt_extra_keys
from sim.cpu_tier import CpuTier
from sim.kv_cache import Adapter, Block, KVCache, KVEvent
from sim.profiles import Profile
from sim.timing import DecodeSeq, PrefillChunk, step_duration


@dataclass(slots=True)
class SimRequest:
    """One request's state inside the engine."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    finish_reason: str
    """What ends the request after `max_tokens` tokens: "length" or "stop"."""
    rng: random.Random
    cache_salt: str | None = None
    lora: Adapter | None = None
    report_full: bool = False
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    blocks: list[Block] = field(default_factory=list)
    num_cached_blocks: int = 0
    """Leading blocks registered in the prefix cache (hits, and blocks whose computation was scheduled)."""
    num_tiered_blocks: int = 0
    """Leading blocks offered to the CPU tier: computed ones only, after their step."""
    cached_tokens: int | None = None
    hasher: BlockHasher | None = None
    aborted: bool = False
    media: tuple[MediaSpan, ...] = ()
    """The prompt's image/audio items: their placeholder runs and identifiers key the blocks they overlap."""
    external_tokens: int = 0
    """Leading prompt tokens a decode engine loads from a prefill engine instead of computing (sim/roles.py)."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """A token sampled for a request in one step."""

    request_id: str
    token_id: int
    finish_reason: str | None
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class StepResult:
    duration: float
    outputs: list[TokenOutput]
    events: list[KVEvent]
    preempted: int


@dataclass(slots=True)
class CoreStats:
    """Cumulative counters exported as vLLM metrics."""

    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    external_queries: int = 0
    external_hits: int = 0


class EngineCore:
    """The scheduler plus KV cache. `step()` advances one batch and says how long it took."""

    def __init__(
        self,
        cache: KVCache,
        profile: Profile,
        max_num_seqs: int,
        vocab: Sequence[int],
        hash_seed: str | None = None,
        tier: CpuTier | None = None,
        max_loras: int = 1,
        lora_load_s: float = 0.0,
    ) -> None:
        if not vocab:
            raise ValueError("vocab for generated tokens is empty")
        self.cache = cache
        self.profile = profile
        self.max_num_seqs = max_num_seqs
        self.vocab = list(vocab)
        self.hash_seed = hash_seed
        self.tier = tier
        self.max_loras = max_loras
        self.lora_load_s = lora_load_s
        self._lora_slots: OrderedDict[str, None] = OrderedDict()
        """Adapters loaded in the engine's LoRA slots, least recently used first."""
        self._load_s = 0.0
        """Engine time spent this step loading blocks back from the CPU tier."""
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.stats = CoreStats()
        self._pending_reset = False
        self._by_id: dict[str, SimRequest] = {}
        self.connector = False
        """The engine runs a KV connector: vLLM then asks it about every request's uncached tokens
        (``vllm:external_prefix_cache_queries``), whether or not it finds them."""

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def max_model_len(self) -> int:
        """The longest sequence that can ever fit in this engine's KV cache."""
        return self.cache.usable_blocks * self.block_size

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._pending_reset)

    def add(self, req: SimRequest) -> None:
        """Queue a request; the caller has checked prompt + max_tokens <= max_model_len."""
        lora = None if req.lora is None else (req.lora.name, req.lora.path)
        req.hasher = BlockHasher(self.block_size, req.cache_salt, self.hash_seed, lora, req.media)
        self.waiting.append(req)
        self._by_id[req.request_id] = req

    def abort(self, request_id: str) -> None:
        """Client went away: release the request's blocks now."""
        req = self._by_id.pop(request_id, None)
        if req is None:
            return
        req.aborted = True
        if req in self.running:
            self.running.remove(req)
            self.cache.free(req.blocks)
            req.blocks = []
        elif req in self.waiting:
            self.waiting.remove(req)

    def request_reset(self) -> None:
        """reset_prefix_cache: applied (and AllBlocksCleared published) at the next step."""
        self._pending_reset = True

    def _extra_keys(self, req: SimRequest, n_blocks: int) -> list[tuple[Any, ...] | None]:
        lora = None if req.lora is None else (req.lora.name, req.lora.path)
        bs = self.block_size
        return [salt_extra_keys(i, req.cache_salt, lora, block_media(req.media, i, bs) if req.media else ())
                for i in range(n_blocks)]

    def _hashes(self, req: SimRequest) -> list[bytes]:
        assert req.hasher is not None
        req.hasher.extend(req.all_token_ids())
        return req.hasher.hashes

    def _blocks_needed(self, req: SimRequest, upto_tokens: int) -> int:
        return -(-upto_tokens // self.block_size) - len(req.blocks)

    def _preempt(self, victim: SimRequest) -> None:
        self.cache.free(victim.blocks)
        victim.blocks = []
        victim.num_computed = 0
        victim.num_cached_blocks = 0
        victim.num_tiered_blocks = 0
        self.waiting.appendleft(victim)
        self.stats.preemptions += 1

    def _schedule_running(self, budget: int) -> tuple[list[tuple[SimRequest, int]], int, int]:
        scheduled: list[tuple[SimRequest, int]] = []
        preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed, budget)
            need = self._blocks_needed(req, req.num_computed + num_new)
            while need > self.cache.num_free:
                victim = self.running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is req:
                    break
            if req not in self.running:
                break
            if need > 0:
                got = self.cache.allocate(need)
                assert got is not None
                req.blocks.extend(got)
            self._commit(req, num_new)
            scheduled.append((req, num_new))
            budget -= num_new
            i += 1
        return scheduled, budget, preempted

    def _admit(self, req: SimRequest, budget: int) -> int | None:
        """Give a waiting request its cache hit and blocks; the number of tokens to compute, or None."""
        hashes = self._hashes(req)
        max_hit_blocks = (req.num_tokens - 1) // self.block_size
        hit = self.cache.find_cached_prefix(hashes, max_hit_blocks)
        tier_blocks = self.tier.match(hashes, len(hit), max_hit_blocks) if self.tier is not None else 0
        hit_tokens = (len(hit) + tier_blocks) * self.block_size
        loaded = max(0, req.external_tokens - hit_tokens) if not req.output_ids else 0
        num_new = min(req.num_tokens - hit_tokens - loaded, budget)
        need = -(-(hit_tokens + loaded + num_new) // self.block_size) - len(hit)
        if need + self.cache.evictable_among(hit) > self.cache.num_free:
            return None
        self.cache.touch(hit)
        got = self.cache.allocate(need)
        assert got is not None
        req.blocks = hit + got
        req.num_computed = hit_tokens + loaded
        req.num_cached_blocks = req.num_tiered_blocks = len(hit) + tier_blocks
        if tier_blocks:
            self._load(req, hashes, len(hit), len(hit) + tier_blocks)
        if req.cached_tokens is None:
            req.cached_tokens = hit_tokens + loaded
            self.stats.prefix_queries += req.num_tokens
            self.stats.prefix_hits += len(hit) * self.block_size
            self.stats.prompt_tokens += req.num_tokens
            if req.external_tokens or self.connector:
                self.stats.external_queries += req.num_tokens - hit_tokens
                self.stats.external_hits += loaded
        if req.report_full and hit:
            self.cache.announce_reused(hashes[: len(hit)], req.all_token_ids(), self._extra_keys(req, len(hit)),
                                       req.lora)
        return num_new

    def _load(self, req: SimRequest, hashes: list[bytes], start: int, end: int) -> None:
        """Blocks ``start..end-1`` come back from the CPU tier: cached in the GPU again (announced there, as
        vLLM does for blocks a connector loaded), their copy time charged to this step."""
        assert self.tier is not None
        self.tier.touch(hashes[start:end])
        self.cache.cache_blocks(req.blocks, hashes, start, end, req.all_token_ids(), self._extra_keys(req, end),
                                req.lora)
        self._load_s += (end - start) * self.tier.block_load_s

    def running_adapters(self) -> set[str]:
        return {r.lora.name for r in self.running if r.lora is not None}

    def _lora_fits(self, req: SimRequest) -> bool:
        """vLLM batches requests of at most ``max_loras`` adapters; a request of a further one is skipped."""
        if req.lora is None:
            return True
        active = self.running_adapters()
        return req.lora.name in active or len(active) < self.max_loras

    def _use_lora(self, req: SimRequest) -> None:
        """An adapter not in a slot is loaded into the least recently used one; the load is charged to the step."""
        if req.lora is None:
            return
        name = req.lora.name
        if name in self._lora_slots:
            self._lora_slots.move_to_end(name)
            return
        if len(self._lora_slots) >= self.max_loras:
            self._lora_slots.popitem(last=False)
        self._lora_slots[name] = None
        self._load_s += self.lora_load_s

    def _schedule_waiting(self, budget: int) -> list[tuple[SimRequest, int]]:
        scheduled: list[tuple[SimRequest, int]] = []
        skipped: list[SimRequest] = []
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.waiting[0]
            if not self._lora_fits(req):
                skipped.append(self.waiting.popleft())
                continue
            num_new = self._admit(req, budget)
            if num_new is None:
                break
            self.waiting.popleft()
            self._use_lora(req)
            self._commit(req, num_new)
            self.running.append(req)
            scheduled.append((req, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return scheduled

    def _commit(self, req: SimRequest, num_new: int) -> None:
        """Cache the blocks this step's ``num_new`` tokens of ``req`` will fill (see the module's docstring)."""
        num_full = (req.num_computed + num_new) // self.block_size
        if num_full > req.num_cached_blocks:
            self.cache.cache_blocks(req.blocks, self._hashes(req), req.num_cached_blocks, num_full,
                                    req.all_token_ids(), self._extra_keys(req, num_full), req.lora)
            req.num_cached_blocks = num_full

    def _advance(self, req: SimRequest, num_new: int, outputs: list[TokenOutput]) -> None:
        req.num_computed += num_new
        num_full = req.num_computed // self.block_size
        if self.tier is not None and num_full > req.num_tiered_blocks:
            self.cache.extend_events(self.tier.store(self._hashes(req), req.num_tiered_blocks, num_full,
                                                     req.all_token_ids(), self.block_size,
                                                     self._extra_keys(req, num_full), req.lora))
            req.num_tiered_blocks = num_full
        if req.num_computed < req.num_tokens:
            return
        token = self.vocab[req.rng.randrange(len(self.vocab))]
        req.output_ids.append(token)
        self.stats.generation_tokens += 1
        finished = req.finish_reason if len(req.output_ids) >= req.max_tokens else None
        outputs.append(TokenOutput(req.request_id, token, finished, req.cached_tokens or 0))
        if finished is not None:
            self.running.remove(req)
            self.cache.free(req.blocks)
            req.blocks = []
            self._by_id.pop(req.request_id, None)

    def step(self) -> StepResult:
        """Schedule one batch, apply its effects, and return its modelled duration and outputs."""
        if self._pending_reset:
            self._pending_reset = False
            self.cache.reset()
        budget = self.profile.max_num_batched_tokens
        scheduled, budget, preempted = self._schedule_running(budget)
        if not preempted:
            scheduled += self._schedule_waiting(budget)
        prefills: list[PrefillChunk] = []
        decodes: list[DecodeSeq] = []
        for req, num_new in scheduled:
            if req.num_computed + num_new <= len(req.prompt_ids) or num_new > 1:
                prefills.append(PrefillChunk(num_new, req.num_computed))
            else:
                decodes.append(DecodeSeq(req.num_computed))
        outputs: list[TokenOutput] = []
        for req, num_new in scheduled:
            self._advance(req, num_new, outputs)
        load_s, self._load_s = self._load_s, 0.0
        return StepResult(
            duration=step_duration(self.profile, prefills, decodes) + load_s,
            outputs=outputs,
            events=self.cache.drain_events(),
            preempted=preempted,
        )
