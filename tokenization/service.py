"""The router's tokenizer: exact vLLM token ids without stalling the event loop.

Per request: render (on the loop, ~15 us; a request of hundreds of messages or megabytes of text in a
thread, see ``RENDER_INLINE_MAX_MESSAGES``), split the text at added tokens, look every segment up in a
token-bounded LRU cache, and encode only the misses: inline when they are short (cheaper than any hop),
in a thread up to ``thread_max_chars`` (HF tokenizers encode in Rust with the GIL released, so the loop
keeps running; the hop costs ~0.1 ms where a worker process round trip cost 1-8 ms on a busy 2-core
machine, most of the router's added time to first token), otherwise in a spawned worker process, so a
huge prompt's Python-side conversion never holds the router's GIL. Every ``verify_every``-th segmented prompt is also
encoded whole and compared; a mismatch turns segmenting off for that tokenizer and the whole-text ids
are used, so a tokenizer that breaks the independence assumption costs speed, never correctness.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import chain
from typing import Any

import trio

from tokenization.cache import TokenCache
from tokenization.registry import LoadedTokenizer, TokenizerRegistry, encode_plain
from tokenization.render import Kind, Prompt, TextPrompt, TokenPrompt, finish, prompts, truncated
from tokenization.worker import WorkerError, WorkerPool

DEFAULT_CACHE_TOKENS = 4_000_000
DEFAULT_INLINE_MAX_CHARS = 4_096
"""Up to about 4k characters (~1k tokens, ~0.5 ms of loop) encoding inline is cheaper than a thread hop: a
300-token turn encodes in 0.22-0.3 ms, while the router's tokenize step with the hop took 1.1-1.7 ms under
``kvmesh bench overhead`` on a 2-core machine, and the hop costs CPU the relay needs at high concurrency."""
DEFAULT_THREAD_MAX_CHARS = 96 * 1024
"""Up to ~20k tokens a thread encodes; beyond, converting the ids to Python lists holds the GIL for long."""
DEFAULT_VERIFY_EVERY = 64
RENDER_INLINE_MAX_MESSAGES = 256
"""Chat templates run Python per message, ~5 us each here (256: 1.4 ms; 20k: 0.1 s). A larger request renders
in a thread: it still holds the GIL, but hands it to the event loop every switch interval (5 ms), so the
loop's stall is bounded by that instead of by the whole render."""
BATCH_SLICE_PROMPTS = 4_096
"""Prompts of a batch per tokenizer call: the call returns its results under the GIL, and one call for half a
million prompts held it (and the event loop) for seconds."""
RENDER_INLINE_MAX_CHARS = 1 << 20
"""Text beyond this (1 MiB renders in ~1 ms, 8 MiB in ~10 ms) also renders in a thread."""
BACKGROUND_INLINE_MAX_CHARS = 512
"""A deferred rest encoded after the request went out (``DeferredIds.complete``) is encoded on the loop only up to
this; longer misses go to a thread, whose encode releases the GIL, so the loop serves other requests meanwhile.
Inline up to ``DEFAULT_INLINE_MAX_CHARS`` (about 0.5 ms of loop each), these encodes were 151 of the router loop's
1,303 py-spy samples on an agentic suite shape (46 streams), on the way to the other streams' first tokens. Below
this the hop costs more than the encode."""
NOW_MAX_CHARS = 16_384
"""A deferred rest this short (16 KB of dense text was 9k tokens, 3.9 ms of CPU to encode) may also be encoded on
the loop when a request waits for it (``DeferredIds.complete_now``)."""
FRESH_SEGMENT_MIN_CHARS = 4_096
"""A segment the cache has never seen that is longer than this (a new system prompt or document of more than
~1,000 tokens) is encoded only up to ``FRESH_HEAD_CHARS`` before routing. Shorter ones are encoded whole (about a
millisecond), so the router's token count of a new prompt stays exact where that is cheap. Encoding the whole of
longer prompts (1,250-3,800 tokens) before routing took 90-555 ms of a request's time to first token (9-47 ms of
CPU, the rest waiting for a thread on a busy 2-core machine), and those first requests of each prefix made
kv_aware's TTFT p90 1.7x round robin's on a multi-turn suite shape."""
FRESH_HEAD_CHARS = 1_024
"""How much of such a segment routes it (150-550 tokens, 10-35 blocks of 16): enough blocks to find the prefix's
home (its first four) and whether any engine holds its start, encoded on the loop. With a 4 KB head, a new
8k-token prompt's tokenizing before routing took 1.5-1.7 ms (1.2-1.3 of them the head's encode) of a 2.3-2.7 ms
decision on a router in front of 15 simulated engines, one request at a time; with 1 KB, 0.7-1.1 ms of 1.5."""


@dataclass
class DeferredIds:
    """A prompt whose cached beginning is known now and whose long fresh rest is still to be encoded.

    ``head`` is a prefix of the prompt's ids (every segment before the first cache miss), enough to look
    the prefix up in the KV index; ``estimated_tokens`` guesses the whole prompt's length from the head's
    characters per token; ``complete`` encodes the rest (filling the cache) and returns all the ids."""

    head: list[int]
    estimated_tokens: int
    complete: Callable[[], Awaitable[list[int]]]
    rest_chars: int = 0
    """Characters of the uncached segments still to encode."""
    fresh: bool = False
    """The head ends inside a segment the cache had never seen (``FRESH_HEAD_CHARS``): the rest must be encoded
    once the request is out, whatever its length, or the next request of the same prefix would see only its
    head cached again and be routed on that."""
    complete_now: Callable[[], list[int]] | None = None
    """``complete`` on the event loop, without a hop to a thread: for a rest of up to ``NOW_MAX_CHARS``
    (None beyond)."""


@dataclass
class ServiceStats:
    prompts: int = 0
    inline_encodes: int = 0
    thread_encodes: int = 0
    worker_encodes: int = 0
    worker_failures: int = 0
    """Worker jobs that failed and were redone in a thread."""
    verifications: int = 0
    segment_mismatches: int = 0
    deferred: int = 0
    """Prompts routed on their cached head while the fresh rest was still being encoded."""
    fresh_heads: int = 0
    """Of those, prompts whose head ends inside a never-seen segment (its first ``FRESH_HEAD_CHARS``)."""
    fresh_head_mismatches: int = 0
    """Fresh heads whose ids were not a prefix of the whole prompt's (then fresh heads stop for the tokenizer)."""
    thread_renders: int = 0
    batch_encodes: int = 0
    """Completions batches (more than one prompt), each encoded in one call in a thread."""


class TokenizerService:
    """Token ids per request for every model in a registry; create it with ``TokenizerService.open``."""

    def __init__(self, registry: TokenizerRegistry, tokenizers: dict[str, LoadedTokenizer], pool: WorkerPool,
                 *, cache_tokens: int, inline_max_chars: int, verify_every: int,
                 thread_max_chars: int = DEFAULT_THREAD_MAX_CHARS) -> None:
        self.registry = registry
        self.tokenizers = tokenizers
        self.pool = pool
        self.cache = TokenCache(cache_tokens)
        self.inline_max_chars = inline_max_chars
        self.thread_max_chars = thread_max_chars
        self.verify_every = verify_every
        self.stats = ServiceStats()
        self._segmented = {spec: tok.plan.segmentable for spec, tok in tokenizers.items()}
        self._fresh_heads = dict.fromkeys(tokenizers, True)
        self._until_verify = dict.fromkeys(tokenizers, max(verify_every, 1))

    @classmethod
    @asynccontextmanager
    async def open(cls, registry: TokenizerRegistry, *, workers: int = 1,
                   cache_tokens: int = DEFAULT_CACHE_TOKENS, inline_max_chars: int = DEFAULT_INLINE_MAX_CHARS,
                   thread_max_chars: int = DEFAULT_THREAD_MAX_CHARS,
                   verify_every: int = DEFAULT_VERIFY_EVERY) -> AsyncIterator[TokenizerService]:
        """Load and check every tokenizer, start the workers, and stop them all on exit."""
        specs = registry.specs()
        tokenizers = {spec: await trio.to_thread.run_sync(LoadedTokenizer.load, spec) for spec in specs}
        pool = WorkerPool(specs, size=workers)
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            yield cls(registry, tokenizers, pool, cache_tokens=cache_tokens,
                      inline_max_chars=inline_max_chars, verify_every=verify_every,
                      thread_max_chars=thread_max_chars)
            nursery.cancel_scope.cancel()

    def fewest_tokens(self, model: object, texts: Sequence[str], above: int) -> int:
        """A lower bound on the tokens of the model's prompt made of ``texts``, without encoding (see
        ``tokenization.bounds``); counting stops once it passes ``above``."""
        return self.tokenizers[self.registry.spec_for(model)].fewest_tokens(texts, above)

    async def token_ids(self, model: object, body: dict[str, Any], kind: Kind,
                        placeholders: Mapping[str, str] | None = None) -> list[int]:
        """The ids vLLM computes for this request (the first prompt of a completions batch); a chat's media
        parts become ``placeholders`` (``tokenization.media``, not yet expanded).

        Raises ``RenderError`` for a request the engine would reject with a 400.
        """
        return (await self.all_token_ids(model, body, kind, placeholders))[0]

    async def all_token_ids(self, model: object, body: dict[str, Any], kind: Kind,
                            placeholders: Mapping[str, str] | None = None) -> list[list[int]]:
        """The ids of every prompt in the request."""
        tok = self.tokenizers[self.registry.spec_for(model)]
        return await self._ids_of(tok, await self._render(tok, body, kind, placeholders))

    def token_text(self, model: object, token_id: int) -> str:
        """The text of one token of the model's tokenizer (a media placeholder's default text)."""
        return self.tokenizers[self.registry.spec_for(model)].hf.decode([token_id])

    async def _render(self, tok: LoadedTokenizer, body: dict[str, Any], kind: Kind,
                      placeholders: Mapping[str, str] | None = None) -> list[Prompt]:
        if not _large(body):
            return prompts(tok.hf, body, kind, placeholders)
        self.stats.thread_renders += 1
        return await trio.to_thread.run_sync(prompts, tok.hf, body, kind, placeholders)

    async def _ids_of(self, tok: LoadedTokenizer, rendered: Sequence[TextPrompt | TokenPrompt],
                      inline_max_chars: int | None = None) -> list[list[int]]:
        if len(rendered) > 1:
            self.stats.prompts += len(rendered)
            self.stats.batch_encodes += 1
            return await trio.to_thread.run_sync(_batch_ids, tok, rendered)
        out = []
        for prompt in rendered:
            self.stats.prompts += 1
            if isinstance(prompt, TokenPrompt):
                ids = prompt.ids
            else:
                ids = await self._text_ids(tok, prompt, inline_max_chars)
            out.append(finish(truncated(ids, prompt.truncate, prompt.keep_left)))
        return out

    async def token_ids_or_head(self, model: object, body: dict[str, Any], kind: Kind,
                                defer_chars: int) -> list[int] | DeferredIds:
        """The prompt's ids, or, when its uncached segments hold at least ``defer_chars`` characters, its
        cached head at once and the rest to encode later: a long fresh user turn adds nothing a KV index
        could match, and encoding it first delayed the first byte by milliseconds per thousand tokens. A prompt
        whose long first segment was never seen (a new system prompt) is routed on that segment's first
        ``FRESH_HEAD_CHARS``.

        Only a lone text prompt without truncation is split this way (truncation may cut the head)."""
        tok = self.tokenizers[self.registry.spec_for(model)]
        found = await self._render(tok, body, kind)
        if len(found) != 1 or not isinstance(found[0], TextPrompt) or found[0].truncate is not None:
            return (await self._ids_of(tok, found))[0]
        prompt = found[0]
        affixes = tok.plan.affixes if prompt.add_special_tokens else ((), ())
        pieces = tok.plan.split(prompt.text) if self._segmented[tok.spec] else []
        cached = [self.cache.peek(tok.spec, piece) for piece in pieces]
        first_miss = next((i for i, ids in enumerate(cached) if ids is None), len(pieces))
        rest_chars = sum(len(p) for p, ids in zip(pieces, cached, strict=True) if ids is None)
        fresh_text = self._fresh_head_text(tok.spec, pieces[0]) if first_miss == 0 and pieces else ""
        if affixes is None or (first_miss == 0 and not fresh_text) or rest_chars < defer_chars:
            return (await self._ids_of(tok, found))[0]
        self.stats.deferred += 1
        fresh = encode_plain(tok.hf, [fresh_text])[0] if fresh_text else []
        self.stats.fresh_heads += bool(fresh_text)
        head = list(chain(affixes[0], *cached[:first_miss], fresh))  # type: ignore[arg-type]  # no None before first_miss
        head_chars = sum(map(len, pieces[:first_miss])) + len(fresh_text)
        rest = len(prompt.text) - head_chars
        estimated = len(head) + len(affixes[1]) + round(rest * (len(head) or 1) / max(head_chars, 1))

        def checked(ids: list[int]) -> list[int]:
            if fresh_text and ids[:len(head)] != head:
                self.stats.fresh_head_mismatches += 1
                self._fresh_heads[tok.spec] = False
            return ids

        async def complete() -> list[int]:
            return checked((await self._ids_of(tok, found, BACKGROUND_INLINE_MAX_CHARS))[0])

        def complete_now() -> list[int]:
            ids = [*affixes[0], *self._plain_ids_now(tok, prompt.text), *affixes[1]]
            return checked(finish(truncated(ids, prompt.truncate, prompt.keep_left)))

        return DeferredIds(head, estimated, complete, rest_chars - len(fresh_text), fresh=bool(fresh_text),
                           complete_now=complete_now if rest_chars <= NOW_MAX_CHARS else None)

    def _fresh_head_text(self, spec: str, segment: str) -> str:
        """The start of a never-seen segment longer than ``FRESH_SEGMENT_MIN_CHARS`` whose ids begin the whole
        segment's: cut before a space that follows a non-space within the first ``FRESH_HEAD_CHARS``, so the last
        word is whole (pre-tokenizers split words at spaces; a run of spaces is not cut). Checked when the whole
        prompt is encoded: one mismatch turns fresh heads off for the tokenizer. Empty when there is none to take."""
        if not self._fresh_heads[spec] or len(segment) <= FRESH_SEGMENT_MIN_CHARS:
            return ""
        cut = segment.rfind(" ", 1, FRESH_HEAD_CHARS)
        while cut > 0 and segment[cut - 1].isspace():
            cut = segment.rfind(" ", 1, cut - 1)
        return segment[:cut] if cut > 0 else ""

    async def _text_ids(self, tok: LoadedTokenizer, prompt: TextPrompt, inline_max_chars: int | None = None
                        ) -> list[int]:
        affixes = tok.plan.affixes if prompt.add_special_tokens else ((), ())
        if affixes is None:
            return await self._encode_with_specials(tok, prompt.text)
        prefix, suffix = affixes
        return [*prefix, *await self._plain_ids(tok, prompt.text, inline_max_chars), *suffix]

    async def _plain_ids(self, tok: LoadedTokenizer, text: str, inline_max_chars: int | None = None) -> list[int]:
        pieces, found, misses = self._looked_up(tok, text)
        joined = self.cache.joined(tok.spec, pieces, found, misses, await self._encode(tok, misses, inline_max_chars))
        if len(pieces) > 1 and self._due_for_check(tok.spec):
            return await self._verified(tok, text, joined)
        return joined

    def _plain_ids_now(self, tok: LoadedTokenizer, text: str) -> list[int]:
        """``_plain_ids`` with the misses encoded on the loop whatever their length (the caller bounds it), and
        no whole-text check (the other path makes those)."""
        pieces, found, misses = self._looked_up(tok, text)
        self.stats.inline_encodes += bool(misses)
        return self.cache.joined(tok.spec, pieces, found, misses, encode_plain(tok.hf, misses))

    def _looked_up(self, tok: LoadedTokenizer, text: str
                   ) -> tuple[list[str], dict[str, tuple[int, ...] | None], list[str]]:
        """The text's segments, their cached ids (None: a miss), and the misses."""
        pieces = tok.plan.split(text) if self._segmented[tok.spec] else [text]
        return pieces, *self.cache.look_up(tok.spec, pieces)

    def _due_for_check(self, spec: str) -> bool:
        self._until_verify[spec] -= 1
        if self._until_verify[spec] > 0:
            return False
        self._until_verify[spec] = self.verify_every
        return True

    async def _verified(self, tok: LoadedTokenizer, text: str, joined: list[int]) -> list[int]:
        """Compare segmented ids with the whole text's; on a mismatch stop segmenting this tokenizer."""
        self.stats.verifications += 1
        (whole,) = await self._encode(tok, [text])
        if whole != joined:
            self.stats.segment_mismatches += 1
            self._segmented[tok.spec] = False
            self.cache.clear(tok.spec)
        return whole

    async def _encode(self, tok: LoadedTokenizer, texts: Sequence[str], inline_max_chars: int | None = None
                      ) -> list[list[int]]:
        """Plain ids of each text: inline if short (up to ``inline_max_chars``, the service's own when None), in
        a thread if middling, else in a worker (a thread if the worker fails)."""
        if not texts:
            return []
        chars = sum(map(len, texts))
        inline_limit = self.inline_max_chars if inline_max_chars is None else min(inline_max_chars,
                                                                                  self.inline_max_chars)
        if chars <= inline_limit:
            self.stats.inline_encodes += 1
            return encode_plain(tok.hf, texts)
        if chars <= self.thread_max_chars:
            self.stats.thread_encodes += 1
            return await trio.to_thread.run_sync(encode_plain, tok.hf, texts, True)
        self.stats.worker_encodes += 1
        try:
            return await self.pool.encode(tok.spec, list(texts))
        except WorkerError:
            self.stats.worker_failures += 1
            return await trio.to_thread.run_sync(encode_plain, tok.hf, texts, True)

    async def _encode_with_specials(self, tok: LoadedTokenizer, text: str) -> list[int]:
        """For tokenizers whose added special tokens are not a fixed prefix and suffix (rare): no cache."""
        if len(text) <= self.inline_max_chars:
            return tok.hf.encode(text, add_special_tokens=True)
        return await trio.to_thread.run_sync(lambda: tok.hf.encode(text, add_special_tokens=True))


def _batch_ids(tok: LoadedTokenizer, rendered: Sequence[Prompt]) -> list[list[int]]:
    """Ids of every prompt of a completions batch, its texts encoded in one call of the Rust tokenizer (that
    releases the GIL), run in a thread: encoded prompt by prompt on the event loop, an 8 MiB batch of short
    prompts held the loop for ~7 s. The segment cache is left out: it belongs to the loop, and a batch is
    rarely the head of a conversation."""
    texts = [p for p in rendered if isinstance(p, TextPrompt)]
    affixes = tok.plan.affixes if texts and texts[0].add_special_tokens else ((), ())
    if affixes is None:
        encoded = iter([tok.hf.encode(p.text, add_special_tokens=True) for p in texts])
    else:
        encoded = iter([[*affixes[0], *ids, *affixes[1]]
                        for start in range(0, len(texts), BATCH_SLICE_PROMPTS)
                        for ids in encode_plain(tok.hf, [p.text for p in texts[start:start + BATCH_SLICE_PROMPTS]],
                                                True)])
    out = []
    for prompt in rendered:
        ids = prompt.ids if isinstance(prompt, TokenPrompt) else next(encoded)
        out.append(finish(truncated(ids, prompt.truncate, prompt.keep_left)))
    return out


def _large(body: dict[str, Any]) -> bool:
    """Whether rendering ``body`` could hold the loop for more than a millisecond or two."""
    if not isinstance(body, dict):
        return False
    messages = body.get("messages")
    if isinstance(messages, list):
        if len(messages) > RENDER_INLINE_MAX_MESSAGES:
            return True
        texts = [m.get("content") for m in messages if isinstance(m, dict)]
    else:
        prompt = body.get("prompt")
        texts = prompt if isinstance(prompt, list) else [prompt]
        if len(texts) > RENDER_INLINE_MAX_MESSAGES:  # a batch of that many prompts (or token ids)
            return True
    return sum(len(t) for t in texts if isinstance(t, str)) > RENDER_INLINE_MAX_CHARS
