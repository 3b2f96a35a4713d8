"""Benchmark workloads as plain data: seeded, deterministic, and free of I/O.

Each workload is a list of conversations. Single-shot workloads use one-turn conversations; the
multi-turn workload feeds every answer back into the history so prefixes grow as in a real chat. The
text is drawn from ``bench.words.WORDS`` (one token per word) so prompt lengths are exact in tokens.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from itertools import accumulate

from bench.words import WORDS

Message = dict[str, str]
WORKLOAD_NAMES = ("a", "b", "c", "d", "e")


def text(rng: random.Random, tokens: int) -> str:
    """``tokens`` words, each a single token with its leading space."""
    return "".join(" " + rng.choice(WORDS) for _ in range(tokens))


def chat_body(messages: list[Message], model: str, max_tokens: int, stream: bool, user: str = "") -> dict:
    """An OpenAI chat-completions request; streaming asks for usage so output tokens are exact."""
    body: dict = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if user:
        body["user"] = user
    return body


@dataclass
class Conversation:
    """User turns sent strictly in order; each answer joins the history the next turn carries."""

    key: str
    user_turns: list[str]
    max_tokens: int
    system: str | None = None
    history: list[Message] = field(default_factory=list)
    sent: int = 0

    @property
    def done(self) -> bool:
        return self.sent >= len(self.user_turns)

    def messages(self) -> list[Message]:
        """The messages of the next turn: system prompt, earlier turns with answers, new user text."""
        return self.prefix_messages(self.sent) + [{"role": "user", "content": self.user_turns[self.sent]}]

    def prefix_messages(self, turn: int) -> list[Message]:
        """What turn ``turn`` shares with earlier requests: the system prompt and the chat so far."""
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return head + self.history[: 2 * turn]

    def body(self, model: str, stream: bool) -> dict:
        user = self.key if len(self.user_turns) > 1 else ""
        return chat_body(self.messages(), model, self.max_tokens, stream, user)

    def record_answer(self, answer: str) -> None:
        """Advance to the next turn; a failed turn records an empty answer so the chat goes on."""
        self.history.append({"role": "user", "content": self.user_turns[self.sent]})
        self.history.append({"role": "assistant", "content": answer})
        self.sent += 1


def _span(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(bounds[0], bounds[1])


def shared_documents(
    seed: int,
    documents: int = 30,
    doc_tokens: tuple[int, int] = (1500, 2500),
    asks: tuple[int, int] = (1, 2),
    question_tokens: tuple[int, int] = (20, 60),
    max_tokens: int = 16,
) -> list[Conversation]:
    """(a) Many documents of about 2k tokens, each asked once or twice, the requests shuffled uniformly.

    The shape of a published gateway's test (3 engines, round robin 40.5% hit, cold TTFT of a 2k-token
    prompt on an A40): primed once each (see ``primers``), a document sits on one engine, so a policy
    blind to the cache finds it there on a first ask 1/N of the time and on a second ask about 2/N
    of the time: about 0.41 overall with 3 engines. Defaults keep every engine's share of the
    documents within a 4096-block cache under any policy, so no policy pays for evictions.
    """
    rng = random.Random(seed)
    docs = [f"Document {d}:" + text(rng, _span(rng, doc_tokens)) for d in range(documents)]
    convs = [
        Conversation(f"doc{d}/q{q}", [text(rng, _span(rng, question_tokens))], max_tokens, docs[d])
        for d in range(documents)
        for q in range(_span(rng, asks))
    ]
    rng.shuffle(convs)
    return convs


def system_prompts(
    seed: int,
    prompts: int = 5,
    prompt_tokens: int = 200,
    requests: int = 160,
    user_tokens: tuple[int, int] = (10, 80),
    max_tokens: int = 16,
) -> list[Conversation]:
    """(b) A few shared system prompts, each request a different user message under one of them."""
    rng = random.Random(seed)
    systems = [f"System {s}:" + text(rng, prompt_tokens) for s in range(prompts)]
    out = []
    for r in range(requests):
        s = rng.randrange(prompts)
        out.append(Conversation(f"sys{s}/r{r}", [text(rng, _span(rng, user_tokens))], max_tokens, systems[s]))
    return out


def multi_turn(
    seed: int,
    conversations: int = 16,
    turns: int = 6,
    system_tokens: int = 100,
    user_tokens: tuple[int, int] = (20, 60),
    max_tokens: int = 32,
) -> list[Conversation]:
    """(c) Chats whose history grows by the previous answer and a new user message each turn."""
    rng = random.Random(seed)
    return [
        Conversation(
            f"chat{c}",
            [text(rng, _span(rng, user_tokens)) for _ in range(turns)],
            max_tokens,
            f"Assistant {c}:" + text(rng, system_tokens),
        )
        for c in range(conversations)
    ]


DEFAULT_MAX_TOKENS = {"a": 16, "b": 16, "c": 16, "d": 128, "e": 16}
"""Answer length per workload when none is given: short answers where only prompts matter; (d)'s answers
are part of what fills the cache."""


def zipf_weights(count: int, exponent: float) -> list[float]:
    """Cumulative Zipf weights: a few hot items and a long tail, as real document popularity."""
    return list(accumulate(1.0 / (rank + 1) ** exponent for rank in range(count)))


def oversized_working_set(
    seed: int,
    capacity_tokens: int,
    factor: float = 2.0,
    doc_tokens: int = 1000,
    requests: int = 240,
    exponent: float = 1.1,
    question_tokens: tuple[int, int] = (20, 60),
    max_tokens: int = DEFAULT_MAX_TOKENS["d"],
) -> list[Conversation]:
    """(d) Documents totalling ``factor`` times the fleet's KV capacity, drawn with Zipf popularity.

    The cache cannot hold everything, so a router must know what was evicted, not only what it sent.
    Answers about a document run to a paragraph (``max_tokens`` 128 by default), and the engine caches
    their blocks too, so what it evicts depends on more than the prompts a router sent it.
    """
    rng = random.Random(seed)
    documents = max(2, math.ceil(factor * capacity_tokens / doc_tokens))
    docs = [f"Document {d}:" + text(rng, doc_tokens) for d in range(documents)]
    order = list(range(documents))
    rng.shuffle(order)
    weights = zipf_weights(documents, exponent)
    picks = rng.choices(order, cum_weights=weights, k=requests)
    return [
        Conversation(f"doc{d}/r{r}", [text(rng, _span(rng, question_tokens))], max_tokens, docs[d])
        for r, d in enumerate(picks)
    ]


def partitioned_prompts(
    seed: int,
    prompts: int = 6,
    prompt_tokens: int = 900,
    asks: int = 15,
    question_tokens: tuple[int, int] = (10, 40),
    max_tokens: int = DEFAULT_MAX_TOKENS["e"],
) -> list[Conversation]:
    """(e) A few long system prompts, each asked ``asks`` times, the requests shuffled uniformly.

    Sized against small engine caches (``PARTITION_NUM_BLOCKS``): six prompts of ~57 blocks are about
    twice one engine's cache and fit the fleet's, so an engine that holds every prompt thrashes while
    one home per prompt (two for the busiest) keeps nearly every request a hit. ``bench.offline_bound``
    says how close to that a policy gets.
    """
    rng = random.Random(seed)
    systems = [f"System {s}:" + text(rng, prompt_tokens) for s in range(prompts)]
    convs = [
        Conversation(f"sys{s}/q{q}", [text(rng, _span(rng, question_tokens))], max_tokens, systems[s])
        for s in range(prompts)
        for q in range(asks)
    ]
    rng.shuffle(convs)
    return convs


PARTITION_NUM_BLOCKS = 160
"""Blocks per engine for workload e (16-token blocks): about half of its six prompts fit one engine."""


def unique_prompts(seed: int, count: int, tokens: int = 24, max_tokens: int = 4) -> list[Conversation]:
    """Warm-up and overhead requests that share nothing with each other or with the workloads."""
    rng = random.Random(f"unique-{seed}")
    return [
        Conversation(f"u{i}", [f"Note {seed}-{i}:" + text(rng, tokens)], max_tokens) for i in range(count)
    ]


def build(
    name: str, seed: int, requests: int | None = None, capacity_tokens: int = 0, max_tokens: int | None = None
) -> list[Conversation]:
    """The named workload (a to e) with its defaults; ``requests`` scales it where that applies."""
    max_tokens = max_tokens or DEFAULT_MAX_TOKENS.get(name, 16)
    if name == "a":
        documents = max(1, round(requests / 1.5)) if requests else 30
        return shared_documents(seed, documents=documents, max_tokens=max_tokens)
    if name == "b":
        return system_prompts(seed, requests=requests or 160, max_tokens=max_tokens)
    if name == "c":
        return multi_turn(seed, conversations=max(1, (requests or 96) // 6), max_tokens=2 * max_tokens)
    if name == "d":
        if capacity_tokens <= 0:
            raise ValueError("workload d needs the fleet's KV capacity in tokens")
        return oversized_working_set(seed, capacity_tokens, requests=requests or 240, max_tokens=max_tokens)
    if name == "e":
        return partitioned_prompts(seed, asks=max(1, round(requests / 6)) if requests else 15, max_tokens=max_tokens)
    raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOAD_NAMES)}")


def total_requests(conversations: list[Conversation]) -> int:
    return sum(len(c.user_turns) for c in conversations)


def primers(conversations: list[Conversation], seed: int, tokens: int = 8) -> list[Conversation]:
    """One request per distinct system prompt, with a question no measured request asks.

    Sent before measuring, they put every shared prefix in some engine's cache, so the measured hit
    rate shows where requests are routed rather than the unavoidable first miss of each prefix. They go
    in their own shuffled order: in the order of first appearance, a round robin would place each primer
    where the first request on the same prefix lands, a hit by lockstep rather than by routing.
    """
    rng = random.Random(f"primer-{seed}")
    systems = list(dict.fromkeys(c.system for c in conversations if c.system is not None))
    rng.shuffle(systems)
    return [Conversation(f"primer{i}", ["Primer:" + text(rng, tokens)], 1, s) for i, s in enumerate(systems)]
