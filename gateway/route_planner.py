"""From a parsed request to a ranked list of engines: tokenize, hash blocks, look up the index, score.

This is the I/O edge around the sans-IO pieces (tokenization, index.block_hash, index.view, routing):
it gathers what they need, calls them once per request, and feeds measured TTFTs back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from gateway import tracing
from gateway.adapters import adapter_terms, chain_model
from gateway.config import RouterConfig
from gateway.engines import EngineRegistry, EngineState
from gateway.metrics import RouterMetrics
from gateway.openai_errors import ApiError
from gateway.proxy import ProxyResult
from gateway.request_body import ParsedRequest
from gateway.routing import (
    Decision,
    EngineView,
    RouteRequest,
    make_policy,
    prefix_key,
    public_engine_name,
    route_header,
    route_table,
)
from gateway.routing.cost import Knowledge
from gateway.routing.homes import HOME_BLOCKS
from gateway.routing.stream_ends import StreamEnd, StreamEnds
from index.block_hash import root_seed
from index.in_flight_blocks import InFlightBlocks, InFlightClaim
from index.media_keys import MediaSpan, media_chain
from index.prefix_index import PrefixIndex
from index.view import CacheOverlap, CacheView
from tokenization.media import MediaItem, Placeholder, expand, media_parts, with_uuids
from tokenization.messages import TEXT_PART_KEYS, RenderError
from tokenization.registry import DEFAULT_TOKENIZER_DIR, TokenizerRegistry
from tokenization.service import DeferredIds, TokenizerService
from tokenization.worker import TokenizerBusy

log = logging.getLogger("kvmesh.planner")

# Policies that look at prompt blocks; the others route without tokenizing at all.
CACHE_POLICIES = frozenset({"kv_aware", "approximate"})
SESSION_HEADERS = ("x-session-id", "x-kvmesh-session")
MAX_KEY_CHARS = 256
# SSE events of a stream that carry no new token: the role chunk (chat) and data: [DONE].
STREAM_FRAMING_EVENTS = 2
DEFER_CHARS = 16_384
"""A fresh part of the prompt at least this long (~4k tokens) is encoded after the request went out: from
there its encode costs more than the 3 ms a router may add to the first token. A turn that long is deferred
whether or not its head decides."""
DEFER_IF_DECIDED_CHARS = 1_024
"""A shorter fresh part, down to this, is not encoded before routing when the cached head already decides the
engine (``head_decides``): encoding a 300-token turn took 0.8-0.9 ms between requests (cold caches) on the way
to the first token, 0.25 ms when warm. Shorter fresh parts are encoded first.

Every deferred part is encoded once the answer has begun (a never-seen system prompt's rest at dispatch,
``RoutePlanner.dispatched``), so that the conversation's next turn finds it cached. Parts whose
head decided used to be left unencoded: an agentic session's later turns then found only their first turn cached
(1.8-1.9k tokens where the engine held 2.5-4.5k; seed 1 suite shape #2), until their uncached history outgrew
``DEFER_CHARS`` and they were routed on that first turn alone, leaving their engine for an idle one (a full
prefill: first tokens of 103-145 ms against 44-50 ms at home): hit 0.744-0.782 in 5 of 7 runs, 0.805 (smg's)
in 4 of 4 since."""


def _begins_with(chains: Mapping[int, Sequence[int]], head: Mapping[int, Sequence[int]]) -> bool:
    """Whether ``chains`` begin with all of ``head``'s blocks (by any block size both have): a block's hash
    carries every block before it."""
    return any(blocks and len(chains.get(size, ())) >= len(blocks) and chains[size][len(blocks) - 1] == blocks[-1]
               for size, blocks in head.items())


def head_holders(chains: Mapping[int, Sequence[int]], overlaps: Mapping[str, CacheOverlap]) -> list[str] | None:
    """The engines holding the whole cached head: only they can hold blocks past it (a prefix walk stops at
    its first miss). None when the head has no full block, and so tells nothing."""
    if not chains or not all(chains.values()):
        return None
    return [engine for engine, found in overlaps.items()
            if max(found.exact_blocks, found.approx_blocks) >= len(chains.get(found.block_size, ()))]


def head_decides(holders: list[str] | None, chosen: Sequence[str]) -> bool:
    """Whether encoding a prompt's fresh rest could not change the engine chosen on its cached head, given
    the head's ``holders`` (``head_holders``): no engine holds the whole head, or exactly one does and was
    chosen (more cached tokens only make it cheaper). With two holders the rest may be cached on either (a
    conversation another replica served, a repeated prompt), so it is encoded first."""
    return holders is not None and (not holders or holders == list(chosen))


@dataclass
class Media:
    """A chat's image/audio items and the placeholders its model expands them to; ``expanded`` fills
    ``spans`` (each item's run in the expanded prompt), which key the blocks they overlap."""

    items: tuple[MediaItem, ...]
    placeholders: dict[str, Placeholder]
    spans: tuple[MediaSpan, ...] = ()

    def expanded(self, token_ids: list[int]) -> list[int]:
        """The prompt as the engine's processor expands it. When placeholders and items disagree (the engine
        refuses such a chat), the prompt before the first placeholder: what can be keyed without them."""
        found = expand(token_ids, self.items, self.placeholders)
        if found is None:
            marks = {p.token_id for p in self.placeholders.values()}
            return token_ids[:next((i for i, t in enumerate(token_ids) if t in marks), len(token_ids))]
        ids, self.spans = found
        return ids


@dataclass
class Plan:
    parsed: ParsedRequest
    decision: Decision
    engines: list[EngineState]
    chains: dict[int, list[int]] = field(default_factory=dict)
    prompt_tokens: int = 0
    estimated: bool = False
    """``prompt_tokens`` is a guess: the fresh rest of the prompt was encoded after routing (see
    ``TokenizerService.token_ids_or_head``); ``chains`` cover the cached head only (a new prompt's whole once
    its rest is encoded after dispatch, ``Plan.rest_done``)."""
    unencoded: DeferredIds | None = None
    """The deferred rest still to encode (``RoutePlanner.encode_rest`` starts it once)."""
    batch_tokens: int = 0
    """Tokens of a completions batch's other prompts: routing reads the first, the tenant pays for all."""
    decided_s: float = 0.0
    """Wall time from the request to its ranked engines (tokenize and score)."""
    dispatched_to: list[str] = field(default_factory=list)
    """The engines told to compute the prompt (``RoutePlanner.dispatched``), whose records cover ``chains``."""
    rest_done: trio.Event | None = None
    """Set for a new prompt routed on its head once its rest is encoded and recorded where it went (see
    ``RoutePlanner.await_computing``)."""
    fresh_rest: DeferredIds | None = None
    """That new prompt's rest until it is recorded whole: a sibling waiting for it may encode it on the loop."""
    busy_claim: InFlightClaim | None = None
    """The blocks the request holds on its engine while in flight (``RoutePlanner.finished`` gives them back)."""
    end_claim: StreamEnd | None = None
    """When the request is expected to end on its engine, while in flight (``RoutePlanner.finished`` drops it)."""

    @property
    def charged_tokens(self) -> int:
        """The prompt tokens the tenant's budget is charged (0: the router did not count them)."""
        return self.prompt_tokens + self.batch_tokens

    @property
    def counted_tokens(self) -> int:
        """The prompt's exact token count, 0 when it was only estimated."""
        return 0 if self.estimated else self.prompt_tokens

    def header(self, engine_id: str, attempts: int, detailed: bool = True) -> str:
        """The ``x-kvmesh-route`` value; cache details only when ``detailed`` (the caller is an admin)."""
        value = route_header(self.decision, detailed)
        if detailed:
            value += f"; decide_ms={self.decided_s * 1e3:.1f}"
        if self.decision.chosen != engine_id:
            value += f"; served_by={engine_id if detailed else public_engine_name(engine_id)}; attempts={attempts}"
        return value

    def explain(self) -> dict[str, Any]:
        return route_table(self.decision)


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _content_texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    texts = []
    for part in content if isinstance(content, list) else ():
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and isinstance(part.get("type"), str):
            text = part.get(TEXT_PART_KEYS.get(part["type"], "text"))
            if isinstance(text, str):
                texts.append(text)
    return texts


def prompt_texts(parsed: ParsedRequest) -> tuple[list[str], int]:
    """(texts, token ids) of the request's longest prompt, read without rendering or encoding.

    A chat prompt is counted as its messages' text: templates add to it (the few that drop earlier
    reasoning drop far less than the slack of the bounds this feeds)."""
    if parsed.kind == "chat":
        messages = parsed.body.get("messages", [])
        return [t for m in messages if isinstance(m, dict) for t in _content_texts(m.get("content"))], 0
    prompt = parsed.body.get("prompt")
    if isinstance(prompt, str):
        return [prompt], 0
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return [], len(prompt)
    items = prompt if isinstance(prompt, list) else []
    longest = max((p for p in items if isinstance(p, str)), key=len, default="")
    return [longest], max((len(p) for p in items if isinstance(p, list)), default=0)


def is_batch(parsed: ParsedRequest) -> bool:
    """Whether the request is a completions batch: several prompts, each text or token ids."""
    prompt = parsed.body.get("prompt") if parsed.kind == "completion" else None
    return isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))


def bounded_key(key: str | None) -> str | None:
    """A session key of at most ``MAX_KEY_CHARS``: longer ones are replaced by their blake2b digest, so
    hashing a client's multi-megabyte ``user`` costs milliseconds, not the event loop's seconds, and the
    key-hash cache holds small keys only."""
    if key is None or len(key) <= MAX_KEY_CHARS:
        return key
    return "blake2b:" + hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def home_key(chain: list[int]) -> str:
    """The hash of the prompt's first ``HOME_BLOCKS`` blocks (of all of them when fewer), which carries
    everything before it; empty when the prompt has no full block."""
    return f"{chain[min(len(chain), HOME_BLOCKS) - 1]:016x}" if chain else ""


def request_prefix_key(parsed: ParsedRequest) -> str:
    if parsed.kind == "completion":
        prompt = parsed.body.get("prompt")
        # Any 100 items print as more than 256 characters: the same key without printing a huge id list.
        return prefix_key(parsed.model, "", prompt if isinstance(prompt, str) else str(prompt[:100])[:256])
    messages = parsed.body.get("messages", [])
    system = next((_text_of(m.get("content")) for m in messages if m.get("role") in ("system", "developer")), "")
    user = next((_text_of(m.get("content")) for m in messages if m.get("role") == "user"), "")
    return prefix_key(parsed.model, system, user)


class RoutePlanner:
    def __init__(self, config: RouterConfig, engines: EngineRegistry, metrics: RouterMetrics) -> None:
        self.config = config
        self.engines = engines
        self.metrics = metrics
        self.policy = make_policy(config.policy)
        self.cache = CacheView(PrefixIndex())
        self.busy = InFlightBlocks()
        self.ends = StreamEnds()
        self.tokenizer_registry = TokenizerRegistry(config.tokenizers, config.tokenizer or str(DEFAULT_TOKENIZER_DIR))
        self.tokenizers: TokenizerService | None = None
        self.share_dispatch: Callable[[str, Sequence[int], float], None] | None = None
        """Set in a mesh: shares speculative and approximate entries with the other replicas."""
        self.peer_in_flight: Callable[[], dict[str, int]] = dict
        """Other replicas' in-flight requests per engine (set by the mesh link; empty without a mesh)."""
        self._background: trio.Nursery | None = None
        """Where deferred encodes run (set while ``run`` runs); without it every prompt is encoded first."""
        self._computing: list[Plan] = []
        """Dispatched new prompts whose rest is not recorded yet (``Plan.rest_done``): one per request in flight."""

    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Load tokenizers and start their workers; they live as long as the router."""
        if self.config.policy not in CACHE_POLICIES:
            task_status.started()
            await trio.sleep_forever()
        async with (TokenizerService.open(self.tokenizer_registry, workers=self.config.tokenizer_workers) as svc,
                    trio.open_nursery() as background):
            self.tokenizers = svc
            self._background = background
            task_status.started()
            await trio.sleep_forever()

    @property
    def reads_events(self) -> bool:
        """Whether KV events feed this router's index (every policy but ``approximate``)."""
        return self.policy.knowledge is not Knowledge.ROUTER_ONLY

    async def _encode_now(self, parsed: ParsedRequest, deferred: DeferredIds, engine_ids: list[str], now: float
                          ) -> tuple[list[int], dict[int, list[int]], dict[str, CacheOverlap]]:
        """A deferred prompt's whole ids, encoded before routing after all, with its chains and overlaps: on the loop
        when its rest is short (``DeferredIds.complete_now``), since the request waits for it either way and a hop to
        a thread also waits for every task ready before its answer."""
        with tracing.step("tokenize"):
            token_ids = deferred.complete_now() if deferred.complete_now is not None else await deferred.complete()
        chains = self._chains(parsed, token_ids, engine_ids)
        return token_ids, chains, self.cache.overlaps(chains, engine_ids, now)

    def _events_tell_all(self, engine_ids: list[str]) -> bool:
        """Whether every candidate's cache is known from its events. What the router knows of an engine
        without them (or under the ``approximate`` policy) is only the blocks it sent there, and a fresh rest
        routed unencoded would never be recorded: a conversation's next turn could not find its engine."""
        infos = [self.cache.info(e) for e in engine_ids]
        return self.reads_events and all(info is not None and info.has_events for info in infos)

    def register_engine(self, engine: EngineState, has_events: bool) -> None:
        self.cache.register(engine.id, block_size=engine.block_size, has_events=has_events,
                            capacity_blocks=engine.load.num_blocks)

    async def _token_ids(self, parsed: ParsedRequest, media: Media | None
                         ) -> tuple[list[int] | DeferredIds, int]:
        """The ids routing reads (a completions batch's first prompt), and the tokens of the batch's other
        prompts. A chat with media is encoded whole, its placeholders expanded (``Media``)."""
        assert self.tokenizers is not None
        try:
            if media is not None:
                texts = {modality: p.text for modality, p in media.placeholders.items()}
                return media.expanded(await self.tokenizers.token_ids(parsed.model, parsed.body, parsed.kind,
                                                                      texts)), 0
            if is_batch(parsed):
                every = await self.tokenizers.all_token_ids(parsed.model, parsed.body, parsed.kind)
                return every[0], sum(len(ids) for ids in every[1:])
            if self._background is None:
                return await self.tokenizers.token_ids(parsed.model, parsed.body, parsed.kind), 0
            return await self.tokenizers.token_ids_or_head(parsed.model, parsed.body, parsed.kind,
                                                           DEFER_IF_DECIDED_CHARS), 0
        except RenderError as exc:
            raise ApiError(400, exc.message, param=exc.param) from None
        except TokenizerBusy as exc:
            raise ApiError(429 if exc.own_load else 503, str(exc), code="tokenizer_busy", retry_after=1) from None

    async def _complete(self, deferred: DeferredIds, plan: Plan) -> None:
        """Encode a deferred prompt's rest, so the conversation's next turn finds it cached; a new prompt's
        (``Plan.rest_done``) whole blocks are then recorded where it was sent, and its siblings told.

        The request has already gone out: nothing here may reach it or the nursery this runs in, whose
        failure would end the router. A refused job (``TokenizerBusy``: the tenant's queue is full or the
        job waited too long, as a dozen concurrent long prompts make it), a render error or a failed worker
        only costs the next turn its cached rest; it is logged and counted, never raised."""
        try:
            self._recorded_whole(plan, await deferred.complete())
        except Exception as exc:  # noqa: BLE001 - an owner of a background task: log once, count, go on
            self._encode_failed(exc, "dropped")
        finally:
            self._computed(plan)

    def _recorded_whole(self, plan: Plan, token_ids: list[int]) -> None:
        """A new prompt's (``Plan.rest_done``) whole blocks, recorded where it was sent (once)."""
        if plan.rest_done is None or plan.rest_done.is_set():
            return
        plan.chains = self._chains(plan.parsed, token_ids, [e.id for e in plan.engines])
        for engine_id in plan.dispatched_to:
            self._record_dispatch(plan, engine_id)
        self._computed(plan)

    def _computed(self, plan: Plan) -> None:
        """A new prompt's siblings need not wait for it any more (recorded whole, or its rest failed)."""
        if plan.rest_done is not None and not plan.rest_done.is_set():
            plan.rest_done.set()
            plan.fresh_rest = None
            self._computing.remove(plan)

    def _encode_failed(self, exc: Exception, outcome: str) -> None:
        reason = type(exc).__name__
        self.metrics.background_encode_failures.labels(reason).inc()
        log.warning("deferred encode of a prompt's rest %s (%s: %s)", outcome, reason, exc)

    def _context_length(self, candidates: list[EngineState]) -> int | None:
        """The largest context any candidate takes; None when one of them has no known length."""
        lengths = [e.max_model_len or self.config.limits.max_model_len for e in candidates]
        return max(lengths) if lengths and all(lengths) else None

    def refuse_overlength(self, parsed: ParsedRequest, candidates: list[EngineState]) -> None:
        """Refuse (400) a prompt that cannot fit any candidate's context, before tokenizing it.

        The token count is bounded from below by characters and words (``tokenization.bounds``): a 1 MB
        prompt is refused in milliseconds instead of seconds of encoding. The bound never refuses a prompt
        the engine would take; prompts between it and the context are refused by the engine.
        ``truncate_prompt_tokens`` makes any length fit."""
        context = self._context_length(candidates)
        if context is None or parsed.body.get("truncate_prompt_tokens") not in (None, -1):
            return
        texts, ids = prompt_texts(parsed)
        assert self.tokenizers is not None
        try:
            fewest = max(ids, self.tokenizers.fewest_tokens(parsed.model, texts, context))
        except RenderError as exc:
            raise ApiError(400, exc.message, param=exc.param) from None
        if fewest > context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens. However, your request "
                           f"has at least {fewest} input tokens. Please reduce the length of the input.",
                           param="messages" if parsed.kind == "chat" else "prompt", code="context_length_exceeded")

    def _chains(self, parsed: ParsedRequest, token_ids: list[int], engine_ids: list[str],
                spans: tuple[MediaSpan, ...] = ()) -> dict[int, list[int]]:
        base, adapter = chain_model(parsed.model, filter(None, map(self.engines.get, engine_ids)))
        seed = root_seed(base, adapter, parsed.cache_salt)
        return {size: media_chain(token_ids, size, seed, spans) for size in self.cache.block_sizes(engine_ids)}

    def _media(self, parsed: ParsedRequest) -> tuple[ParsedRequest, Media | None, bool]:
        """A chat's media: the request to forward (each item's identifier as its ``uuid``), what keys its
        blocks, and whether the router can key them at all (not for a model without a ``[multimodal]``
        table, or with media it does not name: such a chat is routed without reading the cache)."""
        if parsed.kind != "chat" or not media_parts(parsed.body.get("messages")):
            return parsed, None, True
        setting = self.config.multimodal.get(parsed.model)
        tokenizers = self.tokenizers
        if setting is None or tokenizers is None:
            return parsed, None, False
        try:
            placeholders = setting.placeholders(lambda token: tokenizers.token_text(parsed.model, token))
        except RenderError:  # no tokenizer for the model: the encode would refuse it the same way
            return parsed, None, False
        placeholders = {m: p for m, p in placeholders.items() if p.text}  # a token id the vocabulary lacks
        body, items = with_uuids(parsed.body)
        forwarded = dataclasses.replace(parsed, body=body, raw=json.dumps(body, separators=(",", ":")).encode())
        keyed = {item.modality for item in items} <= placeholders.keys()
        return forwarded, Media(items, placeholders) if keyed else None, keyed

    async def plan(self, parsed: ParsedRequest, headers: Mapping[str, str]) -> Plan:
        candidates = self.engines.for_model(parsed.model)
        if not candidates:
            raise ApiError(404, f"The model `{parsed.model}` does not exist.", param="model",
                           code="model_not_found")
        started = trio.current_time()
        ids = [e.id for e in candidates]
        token_ids: list[int] = []
        prompt_tokens = batch_tokens = 0
        deferred: DeferredIds | None = None
        chains: dict[int, list[int]] = {}
        now = trio.current_time()
        parsed, media, keyed = self._media(parsed)
        if self.policy.name in CACHE_POLICIES and keyed:
            with tracing.step("tokenize") as span:
                self.refuse_overlength(parsed, candidates)
                found, batch_tokens = await self._token_ids(parsed, media)
                if isinstance(found, DeferredIds):
                    deferred, token_ids, prompt_tokens = found, found.head, found.estimated_tokens
                else:
                    token_ids = found
                    prompt_tokens = len(found)
                chains = self._chains(parsed, token_ids, ids, media.spans if media is not None else ())
                span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
        with tracing.step("route") as span:
            if await self.await_computing(chains):
                now = trio.current_time()
                if deferred is not None:
                    deferred, token_ids, chains, _ = None, *await self._encode_now(parsed, deferred, ids, now)
                    prompt_tokens = len(token_ids)
            overlaps = self.cache.overlaps(chains, ids, now) if chains else {}
            # A never-seen prefix is routed on its head only while that head decides, however long its rest.
            short_rest = deferred is not None and (deferred.rest_chars < DEFER_CHARS or deferred.fresh)
            holders = head_holders(chains, overlaps) if short_rest and self._events_tell_all(ids) else None
            if short_rest and (holders is None or len(holders) > 1):  # the rest may matter whatever is chosen
                deferred, token_ids, chains, overlaps = None, *await self._encode_now(parsed, deferred, ids, now)
                prompt_tokens, short_rest = len(token_ids), False
            decision = self._decide(parsed, headers, candidates, prompt_tokens, chains, overlaps)
            if short_rest and not head_decides(holders, decision.ranked[:1]):  # the one holder was not chosen
                deferred, token_ids, chains, overlaps = None, *await self._encode_now(parsed, deferred, ids, now)
                prompt_tokens = len(token_ids)
                decision = self._decide(parsed, headers, candidates, prompt_tokens, chains, overlaps)
            span.set_attribute("kvmesh.route.policy", decision.policy)
            span.set_attribute("kvmesh.route.reason", decision.reason)
            if decision.table:
                span.set_attribute("kvmesh.route.engine", decision.table[0].engine)
                span.set_attribute("kvmesh.route.overlap_tokens", decision.table[0].overlap_tokens)
        by_id = {e.id: e for e in candidates}
        ranked = [by_id[i] for i in decision.ranked]
        if not ranked:
            raise ApiError(503, f"no engine is available for model `{parsed.model}`", code="no_engine_available")
        self.metrics.decisions.labels(decision.policy, decision.reason.split(" ")[0]).inc()
        decided_s = trio.current_time() - started
        self.metrics.decision_latency.observe(decided_s)
        return Plan(parsed, decision, ranked, chains, prompt_tokens, estimated=deferred is not None,
                    unencoded=deferred, batch_tokens=batch_tokens, decided_s=decided_s)

    async def await_computing(self, chains: Mapping[int, Sequence[int]]) -> bool:
        """Whether the prompt begins with the whole head of a new prompt dispatched before it, after waiting for
        that prompt's rest to be encoded and recorded where it went (``dispatched``).

        Such a prompt used to be recorded by its head alone until its answer began (624 of 3,892 tokens on seed
        0 suite shape #6): to the siblings arriving during its prefill its engine looked like it held a sixth of
        them, and they left to compute it again elsewhere (0.07-0.1 of that shape's bound each time; 0.83-0.98
        of the bound in four runs, 1.00 in four with the whole record). A sibling arriving within the few
        milliseconds of that encode waits for it (then its own encode reads the cached segments): on seed 0
        shape #3, whose new prompts arrive in pairs at once, that let the second of a pair hit (1.09 of the bound
        twice against 1.05)."""
        sharing = [plan for plan in self._computing if _begins_with(chains, plan.chains)]
        for plan in sharing:
            assert plan.rest_done is not None
            self._encode_now_for_sibling(plan)
            await plan.rest_done.wait()
        return bool(sharing)

    def _encode_now_for_sibling(self, plan: Plan) -> None:
        """Encode a new prompt's rest on the loop for the sibling that waits for it, when that rest is short
        (``DeferredIds.complete_now``). Its encode in a thread finishes in a millisecond or two, but the task
        that records it runs only after every task ready before it: in an opening burst, after the other
        requests' decisions. Siblings waited 7-41 ms there (seed 1 suite shape #12: 19 requests at once, two
        system prompts), the first of them longest."""
        rest = plan.fresh_rest
        if rest is None or rest.complete_now is None or plan.rest_done is None or plan.rest_done.is_set():
            return
        try:
            self._recorded_whole(plan, rest.complete_now())
        except Exception as exc:  # noqa: BLE001 - the sibling waits for the encode in the thread instead
            self._encode_failed(exc, "left to the thread")

    def encode_rest(self, plan: Plan) -> None:
        """Start encoding a deferred prompt's fresh rest, once (a new system prompt's rest started at
        dispatch). The router calls this when the answer has begun (and again when the request ends):
        encoding 8k tokens takes ~9 ms of CPU, which, started with the request, competed with the engine's
        prefill and added it to the time to first token; a turn no other request shares gains nothing from
        being recorded sooner."""
        deferred, plan.unencoded = plan.unencoded, None
        if deferred is not None and self._background is not None:
            self._background.start_soon(self._complete, deferred, plan)

    def _decide(self, parsed: ParsedRequest, headers: Mapping[str, str], candidates: list[EngineState],
                prompt_tokens: int, chains: dict[int, list[int]], overlaps: Mapping[str, CacheOverlap]) -> Decision:
        peers = self.peer_in_flight()
        now = trio.current_time()
        views = []
        _, adapter = chain_model(parsed.model, candidates)
        for engine in candidates:
            found = overlaps.get(engine.id)
            held, recorded = self.cache.held_blocks(engine.id)
            adapter_load_s, slots_full = adapter_terms(adapter, engine.load, self.config.adapter_load_s)
            views.append(EngineView(
                id=engine.id, url=engine.url, island=engine.config.island,
                healthy=engine.healthy and not engine.maintenance, draining=engine.draining,
                in_flight=engine.in_flight, peer_in_flight=peers.get(engine.id, 0), running=engine.load.running,
                finished_since_poll=engine.load.finished_since_poll, rejoining=engine.rejoining,
                waiting=engine.load.waiting, kv_usage=engine.load.kv_usage, num_blocks=engine.load.num_blocks,
                block_size=engine.block_size, exact_blocks=found.exact_blocks if found else 0,
                approx_blocks=found.approx_blocks if found else 0, confidence=found.confidence if found else 0.0,
                held_blocks=held, approx_held_blocks=recorded, reuse_ratio=engine.load.reuse.ratio,
                busy_blocks=self.busy.held(engine.id),
                busy_shared_blocks=self.busy.shared(engine.id, chains.get(engine.block_size, ())),
                stream_remaining_s=self.ends.remaining(engine.id, now),
                tier_runs=engine.config.tiers.priced_runs(found.tiers, engine.block_size) if found else (),
                adapter_load_s=adapter_load_s, adapter_slots_full=slots_full,
            ))
        block_size = min(chains) if chains else 16
        session = bounded_key(next((headers[h] for h in SESSION_HEADERS if headers.get(h)), None) or parsed.user)
        request = RouteRequest(model=parsed.model, prompt_tokens=prompt_tokens,
                               total_blocks=prompt_tokens // block_size, prefix_key=request_prefix_key(parsed),
                               session_key=session, router_island=self.config.island, max_tokens=parsed.max_tokens,
                               home_key=home_key(chains.get(block_size, [])))
        return self.policy.choose(request, views)

    def engine_recovered(self, engine_id: str) -> None:
        """An engine is back after being down (restarted, paused, replaced): its learned speed is stale and
        may be the slowness of the fault itself; judge it by the fleet until it has served again."""
        self.policy.costs.learner.forget(engine_id)
        self.policy.costs.decode.forget(engine_id)
        self.policy.forget_engine(engine_id)
        engine = self.engines.get(engine_id)
        if engine is not None:
            engine.rejoining = True

    def dispatched(self, plan: Plan) -> None:
        """The request passed admission and goes to its first choice: remember the prompt's blocks there
        until the engine's events confirm them, so a burst of siblings does not race ahead of the events.

        A new system prompt routed on its head (``DeferredIds.fresh``) has its rest encoded now, not once its
        answer has begun, and is recorded whole where it went when that is done (``await_computing``)."""
        self.policy.dispatched(plan.decision, plan.engines[0].id)
        self._record_dispatch(plan, plan.engines[0].id)
        self._claim_busy(plan, plan.engines[0])
        self._claim_end(plan, plan.engines[0].id)
        plan.dispatched_to.append(plan.engines[0].id)
        if plan.unencoded is not None and plan.unencoded.fresh and self._background is not None:
            plan.rest_done = trio.Event()
            plan.fresh_rest = plan.unencoded
            self._computing.append(plan)
            self.encode_rest(plan)

    def _claim_busy(self, plan: Plan, engine: EngineState) -> None:
        """Hold the request's prompt blocks and expected answer on its engine until it ends (``finished``)."""
        if plan.busy_claim is None:
            block = max(1, engine.block_size)
            chain = plan.chains.get(engine.block_size, ())
            answer = self.policy.costs.decode.expected_output_tokens(plan.parsed.max_tokens)
            private = max(0, math.ceil(plan.prompt_tokens / block) - len(chain)) + math.ceil(answer / block)
            plan.busy_claim = self.busy.add(engine.id, chain, private)

    def _claim_end(self, plan: Plan, engine_id: str) -> None:
        """Note when the request should end there: now plus the decision's estimate to its last token."""
        score = next((s for s in plan.decision.table if s.engine == engine_id), None)
        if plan.end_claim is None and score is not None:
            plan.end_claim = self.ends.add(engine_id, trio.current_time() + score.done_s)

    def finished(self, plan: Plan) -> None:
        """The request ended (answered, failed or abandoned): its engine's blocks are no longer held for it, nor
        its end expected."""
        claim, plan.busy_claim = plan.busy_claim, None
        if claim is not None:
            self.busy.release(claim)
        end, plan.end_claim = plan.end_claim, None
        if end is not None:
            self.ends.release(end)

    def dispatched_prefill(self, plan: Plan, engines: list[EngineState]) -> None:
        """A prefill leg will compute the prompt there too: remember its blocks on that engine as well."""
        for engine in engines:
            self._record_dispatch(plan, engine.id)
            plan.dispatched_to.append(engine.id)

    def _record_dispatch(self, plan: Plan, engine_id: str) -> None:
        if plan.chains:
            keys, ttl = self.cache.record_dispatch(engine_id, plan.chains, trio.current_time())
            if keys and self.share_dispatch is not None:
                self.share_dispatch(engine_id, keys, ttl)

    def observe(self, plan: Plan, result: ProxyResult, prefilled: bool = False) -> None:
        """Feed the measured time to first byte back into the cost model of the engine that served it.

        Only streamed, first-attempt answers teach the model: a non-streamed first byte includes decoding.
        A decode leg (``prefilled``: another engine computed its prompt) teaches only the decode model: its
        first token would tell the TTFT model that the engine prefills in no time."""
        if result.engine is None or result.ttft_s is None:
            return
        result.engine.rejoining = False
        engine_id = result.engine.id
        self.metrics.ttft.labels(engine_id).observe(result.ttft_s)
        score = next((s for s in plan.decision.table if s.engine == engine_id), None)
        if score is None:
            return
        self.metrics.predicted_cached.inc(score.cached_tokens)
        reported = result.cached_tokens()
        if reported is not None:
            self.metrics.reported_cached.inc(reported)
        if len(result.attempts) == 1 and plan.parsed.stream and not plan.estimated:
            if not prefilled:
                self.policy.observe(engine_id, score.uncached_tokens, score.queue_depth, result.ttft_s)
                self._refit_now(engine_id)
            if not result.broken_after_first_byte and result.events > STREAM_FRAMING_EVENTS:
                self.policy.observe_decode(engine_id, score.queue_depth, result.events - STREAM_FRAMING_EVENTS,
                                           result.total_s - result.ttft_s)

    def prefill_leg_s(self, engine_id: str, work_tokens: int, other_depth: int) -> float:
        """The TTFT model's time for a prefill leg that answers after ``work_tokens`` of prompt there
        (gateway/disaggregation/prefill_load.py)."""
        learner = self.policy.costs.learner
        return learner.params(engine_id, learner.model(engine_id).max_num_seqs).predict(
            work_tokens, other_depth, learner.model(engine_id).max_num_seqs)

    def observe_prefill(self, engine_id: str, work_tokens: int, other_depth: int, seconds: float) -> None:
        """A prefill leg's measured time: its one token came after the work queued ahead and its own prefill,
        which is what the TTFT model's prefill term prices (its queue term gets the other requests ahead)."""
        if self.policy.observe(engine_id, work_tokens, other_depth, seconds):
            self._refit_now(engine_id)

    def _refit_now(self, engine_id: str) -> None:
        """Refit the TTFT model after the answer (the engine's own fit, or the fleet's when its share of new
        answers is in) instead of in the next request's decision, on the path to the first byte. The slots it
        is asked for are the model's own, so only new data trigger the work."""
        learner = self.policy.costs.learner
        learner.params(engine_id, learner.model(engine_id).max_num_seqs)
