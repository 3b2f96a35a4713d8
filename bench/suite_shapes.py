"""Workload shapes for ``kvmesh bench routing --suite``, drawn at random from wide ranges (sans-IO).

A router tuned on workloads (a)-(e) may only fit those; a suite draws shapes nobody tuned on: how popular
the shared prefixes are (uniform to Zipf 1.4), how many (2-64) and how long (200-4,000 tokens), single-turn
questions, multi-turn chats or agentic sessions (long histories growing by tool results), answers of
1-512 tokens, 2-16 engines whose KV capacity is half to three times the working set, 1-64 requests at
once, sent in a closed loop or arriving on their own (Poisson). One seed gives one suite, always the same.

Each run is sized to a few seconds: the request count and the engines' time scale follow from an estimate
of the shape's service time (``budget_s``), so a suite of 20 shapes fits its time budget whatever it draws.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from bench.workloads import Conversation, text, zipf_weights
from sim.profiles import Profile

KINDS = ("single", "multi", "agentic")
PREFIXES = (2, 64)
PREFIX_TOKENS = (200, 4000)
ZIPF = (0.0, 1.4)
"""Popularity exponent: 0 is uniform."""
ANSWER_TOKENS = (1, 512)
ENGINES = (2, 16)
CAPACITY = (0.5, 3.0)
"""Fleet KV capacity as a multiple of the working set."""
CONCURRENCY = (1, 64)
OPEN_LOOP_SHARE = 1 / 3
TURNS = {"single": (1, 1), "multi": (2, 6), "agentic": (3, 8)}
USER_TOKENS = {"single": (10, 60), "multi": (20, 80), "agentic": (150, 600)}
"""Per turn: a question, a chat message, or a tool result appended to an agent's history."""
REQUESTS = (40, 160)
"""Requests per run, before the time budget shortens a slow shape."""
MIN_TIME_SCALE = 0.25
"""Below this the simulated engines' steps are as short as the router's and client's own CPU per request on
a shared 2-core machine, and the run measures the machine instead of the routing."""


def _log_uniform_int(rng: random.Random, bounds: tuple[int, int]) -> int:
    low, high = bounds
    return min(high, max(low, round(math.exp(rng.uniform(math.log(low), math.log(high + 1))) - 0.5)))


@dataclass(frozen=True)
class Shape:
    """One drawn workload shape and the fleet it runs on."""

    index: int
    seed: int
    kind: str
    prefix_tokens: tuple[int, ...]
    zipf: float
    answer_tokens: int
    engines: int
    capacity_ratio: float
    concurrency: int
    open_loop: bool
    turns: tuple[int, int]

    @property
    def prefixes(self) -> int:
        return len(self.prefix_tokens)

    @property
    def label(self) -> str:
        arrival = "open" if self.open_loop else "closed"
        return (f"#{self.index} {self.kind} P={self.prefixes} z={self.zipf:.2f} ans={self.answer_tokens} "
                f"E={self.engines} kv={self.capacity_ratio:.2f}x c={self.concurrency} {arrival}")

    def request_tokens(self) -> int:
        """Tokens of the longest request past its shared prefix: its history and last turn, and the answer."""
        per_turn = USER_TOKENS[self.kind][1] + self.answer_tokens + 12
        return self.turns[1] * per_turn

    def working_set_tokens(self) -> int:
        """What the fleet should hold for every request to hit: every shared prefix once, plus the histories
        of the sessions running at once."""
        live = self.concurrency * self.request_tokens() if self.turns[1] > 1 else 0
        return sum(self.prefix_tokens) + live

    def num_blocks(self, block_size: int) -> int:
        """Blocks per engine: ``capacity_ratio`` of the working set spread over the engines, never less than
        twice the largest request (an engine must admit any one request whole)."""
        largest = max(self.prefix_tokens) + self.request_tokens() + 64
        per_engine = self.capacity_ratio * self.working_set_tokens() / self.engines
        return math.ceil(max(per_engine, 2 * largest) / block_size) + 1


def draw_shape(rng: random.Random, index: int) -> Shape:
    kind = rng.choice(KINDS)
    prefixes = _log_uniform_int(rng, PREFIXES)
    low, high = TURNS[kind]
    turns_low = rng.randint(low, high)
    return Shape(
        index=index,
        seed=rng.randrange(2**31),
        kind=kind,
        prefix_tokens=tuple(rng.randint(*PREFIX_TOKENS) for _ in range(prefixes)),
        zipf=round(rng.uniform(*ZIPF), 2),
        answer_tokens=_log_uniform_int(rng, ANSWER_TOKENS),
        engines=rng.randint(*ENGINES),
        capacity_ratio=round(rng.uniform(*CAPACITY), 2),
        concurrency=_log_uniform_int(rng, CONCURRENCY),
        open_loop=rng.random() < OPEN_LOOP_SHARE,
        turns=(turns_low, rng.randint(turns_low, high)),
    )


def draw_suite(seed: int, count: int) -> list[Shape]:
    """``count`` shapes; the same seed always draws the same suite."""
    rng = random.Random(f"suite-{seed}")
    return [draw_shape(rng, i + 1) for i in range(count)]


@dataclass(frozen=True)
class Plan:
    """How one shape is run: its conversations, the engines' time scale, and the arrival rate (open loop)."""

    conversations: list[Conversation]
    time_scale: float
    arrival_rate: float | None
    """Sessions started per second (Poisson), or None for a closed loop of ``concurrency`` clients."""


def conversations(shape: Shape, requests: int) -> list[Conversation]:
    """Sessions of the shape totalling about ``requests`` requests, each under a prefix drawn by popularity."""
    rng = random.Random(shape.seed)
    systems = [f"System {shape.index}-{p}:" + text(rng, n) for p, n in enumerate(shape.prefix_tokens)]
    order = list(range(shape.prefixes))
    rng.shuffle(order)
    weights = zipf_weights(shape.prefixes, shape.zipf)
    out: list[Conversation] = []
    sent = 0
    while sent < requests:
        turns = min(rng.randint(*shape.turns), requests - sent)
        p = rng.choices(order, cum_weights=weights)[0]
        user = [text(rng, rng.randint(*USER_TOKENS[shape.kind])) for _ in range(turns)]
        out.append(Conversation(f"s{len(out)}/p{p}", user, shape.answer_tokens, systems[p]))
        sent += turns
    return out


DECODE_STEP_FACTOR = 3.0
"""A streamed answer token costs about three times the engine's bare step once batching and the trip through
the router to the client count on a busy 2-core machine (shape #1 of seed 0 ran 11-13 s where one step per
token predicted 4-6 s)."""


def service_s(shape: Shape, profile: Profile) -> float:
    """A rough time per request at time scale 1: overhead, half its prompt prefilled, its answer streamed."""
    prompt = sum(shape.prefix_tokens) / shape.prefixes + shape.request_tokens() / 2
    decode = DECODE_STEP_FACTOR * profile.step_base_s * shape.answer_tokens
    return profile.frontend_s + profile.prefill_token_s * prompt / 2 + decode


def wall_s(shape: Shape, per_request_s: float, requests: int) -> float:
    """Estimated wall time of a run of ``requests`` at time scale 1. A session's turns go one after the other,
    so its length counts as well as the request count: in a closed loop the run lasts at least the longest
    session, and no more sessions run at once than there are; an open loop starts its last session near the
    end and waits for all its turns. Counting only requests over concurrency made long-answer sessions overrun
    the budget 5-12x (seed 0: an agentic shape of 311-token answers ran 32 s for a 4 s budget)."""
    mean_turns = sum(shape.turns) / 2
    sessions = max(1.0, requests / mean_turns)
    parallel = max(1.0, min(shape.concurrency, shape.engines * 8, sessions))
    if shape.open_loop:
        return per_request_s * (requests / parallel + shape.turns[1])
    return per_request_s * max(requests / parallel, shape.turns[1])


def plan(shape: Shape, profile: Profile, budget_s: float) -> Plan:
    """Size the run to about ``budget_s`` of wall time (``wall_s``): fewer requests first (down to
    ``REQUESTS[0]``), then a faster engine clock (down to ``MIN_TIME_SCALE``)."""
    per_request = service_s(shape, profile)
    requests = next((n for n in range(REQUESTS[1], REQUESTS[0] - 1, -1) if wall_s(shape, per_request, n) <= budget_s),
                    REQUESTS[0])
    scale = min(1.0, max(MIN_TIME_SCALE, budget_s / wall_s(shape, per_request, requests)))
    rate = None
    if shape.open_loop:
        turns = sum(shape.turns) / 2
        rate = shape.concurrency / (per_request * scale * turns)
    return Plan(conversations(shape, requests), round(scale, 3), rate)
