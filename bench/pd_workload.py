"""What ``kvmesh bench pd`` sends and how it sums it up (sans-IO).

Requests share long documents (4-32k tokens) and add a question of their own (1-2k tokens: a user's
context, computed on every request), then ask for a 128-512-token answer. Several requests per document
make the prefix worth finding; the question is what makes prefills interrupt decoding on an engine that
does both.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field

from bench.stats import percentile
from bench.words import WORDS


@dataclass(frozen=True)
class PdWorkload:
    documents: int = 12
    doc_tokens: tuple[int, int] = (4096, 32768)
    question_tokens: tuple[int, int] = (1024, 2048)
    answer_tokens: tuple[int, int] = (128, 512)
    seed: int = 0

    def docs(self) -> list[str]:
        rng = random.Random(self.seed)
        return [_words(rng, rng.randint(*self.doc_tokens)) for _ in range(self.documents)]

    def requests(self, count: int, docs: list[str], model: str, offset: int = 0) -> list[dict]:
        """``count`` streamed chat requests (each with its own question), documents cycled in a shuffled order."""
        rng = random.Random(self.seed * 7919 + offset)
        order = [i % len(docs) for i in range(count)]
        rng.shuffle(order)
        out = []
        for i, doc in enumerate(order):
            question = f"question {offset + i}:" + _words(rng, rng.randint(*self.question_tokens))
            out.append({"model": model, "stream": True, "stream_options": {"include_usage": True},
                        "max_tokens": rng.randint(*self.answer_tokens), "seed": offset + i,
                        "messages": [{"role": "system", "content": docs[doc]},
                                     {"role": "user", "content": question}]})
        return out


def _words(rng: random.Random, count: int) -> str:
    return "".join(" " + WORDS[rng.randrange(len(WORDS))] for _ in range(count))


@dataclass
class StreamTimes:
    """When each text-carrying event of one streamed answer arrived, from the request's start."""

    tokens: list[float] = field(default_factory=list)
    output_tokens: int = 0
    ok: bool = False

    @property
    def ttft(self) -> float | None:
        return self.tokens[0] if self.tokens else None

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.tokens, self.tokens[1:], strict=False)]


@dataclass(frozen=True)
class PdRow:
    setup: str
    concurrency: int
    requests: int
    errors: int
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    tokens_per_s: float
    skipped: dict[str, int]
    hit_rate: float = 0.0
    """Share of the prompt tokens sent to prefilling engines (prefill engines, or all four aggregated) that
    they found in their prefix cache."""
    round: int = 0


def summarize(setup: str, concurrency: int, runs: list[StreamTimes], wall: float, skipped: dict[str, int],
              hit_rate: float = 0.0, round_: int = 0) -> PdRow:
    good = [r for r in runs if r.ok and r.tokens]
    ttfts = [r.ttft for r in good if r.ttft is not None]
    gaps = [g for r in good for g in r.gaps()]
    return PdRow(setup, concurrency, len(runs), len(runs) - len(good), percentile(ttfts, 50), percentile(ttfts, 99),
                 percentile(gaps, 50), percentile(gaps, 99),
                 sum(r.output_tokens for r in good) / wall if wall > 0 else math.nan, skipped, hit_rate, round_)


def format_rows(rows: list[PdRow]) -> str:
    head = (f"{'round':>5} {'setup':<22} {'c':>3} {'req':>4} {'err':>3} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
            f"{'ITL p99':>8} {'out tok/s':>10} {'hit %':>6}  P leg skipped (why)")
    lines = [head]
    for r in rows:
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(r.skipped.items())) or "-"
        lines.append(f"{r.round:>5} {r.setup:<22} {r.concurrency:>3} {r.requests:>4} {r.errors:>3} "
                     f"{r.ttft_p50 * 1e3:>9.0f} {r.ttft_p99 * 1e3:>9.0f} {r.itl_p50 * 1e3:>8.1f} "
                     f"{r.itl_p99 * 1e3:>8.1f} {r.tokens_per_s:>10.0f} {r.hit_rate * 100:>6.1f}  {skipped}")
    lines.append("(TTFT and ITL in ms of wall time, measured at the client through the router; hit %: prompt "
                 "tokens the prefilling engines served from cache)")
    return "\n".join(lines)


def verdicts(rows: list[PdRow]) -> list[str]:
    """The two claims the comparison exists for, judged on each round's numbers and then over the rounds."""
    rounds = sorted({r.round for r in rows})
    out, held = [], {}
    for turn in rounds:
        lines, claims = _round_verdicts([r for r in rows if r.round == turn])
        out += lines if len(rounds) == 1 else [f"round {turn}: {line}" for line in lines]
        for claim, (ok, ratio) in claims.items():
            held.setdefault(claim, []).append((ok, ratio))
    if len(rounds) > 1:
        for claim, results in held.items():
            ratios = ", ".join(f"x{ratio:.2f}" for _, ratio in results)
            out.append(f"{claim}: {sum(ok for ok, _ in results)} of {len(results)} rounds ({ratios})")
    return out


def _compared(label: str, ours: float, other: str, theirs: float, word: str, digits: int
              ) -> tuple[str, tuple[bool, float]]:
    """One claim of a round: ``ours`` below ``theirs`` (seconds, printed in ms), and its ratio."""
    ok, ratio = ours < theirs, theirs / ours
    verdict = word if ok else f"NOT {word}"
    return f"{label} {ours * 1e3:.{digits}f} ms vs {other} {theirs * 1e3:.{digits}f} ms ({verdict}, x{ratio:.2f})", \
        (ok, ratio)


def _round_verdicts(rows: list[PdRow]) -> tuple[list[str], dict[str, tuple[bool, float]]]:
    by = {(r.setup, r.concurrency): r for r in rows}
    top = max(r.concurrency for r in rows)
    lines, claims = [], {}
    pd, agg = by.get(("kvmesh P/D", top)), by.get(("kvmesh aggregated", top))
    if pd and agg:
        line, claims[f"kvmesh P/D ITL p99 lower than aggregated at c={top}"] = _compared(
            f"ITL p99 at c={top}: kvmesh P/D", pd.itl_p99, "aggregated", agg.itl_p99, "lower", 1)
        lines.append(line)
    for c in sorted({r.concurrency for r in rows}):
        pd, rr = by.get(("kvmesh P/D", c)), by.get(("round-robin P/D", c))
        if pd and rr:
            line, claims[f"kvmesh P choice TTFT p50 better than round robin at c={c}"] = _compared(
                f"TTFT p50 at c={c}: kvmesh P choice", pd.ttft_p50, "round-robin", rr.ttft_p50, "better", 0)
            lines.append(line)
    return lines, claims


def medians(rows: list[PdRow]) -> dict[tuple[str, int], tuple[float, float, float, float]]:
    """Per setup and concurrency, the median over rounds of TTFT p50/p99 and ITL p50/p99 (for the plot)."""
    out = {}
    for key in {(r.setup, r.concurrency) for r in rows}:
        mine = [r for r in rows if (r.setup, r.concurrency) == key]
        out[key] = tuple(statistics.median(getattr(r, f) for r in mine)
                         for f in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"))
    return out
