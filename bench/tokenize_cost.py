"""Routing-path tokenization latency for 1k/8k/32k-token chat prompts, cold and warm.

Cold: a conversation never seen before (every segment misses the cache). Warm: the same conversation
plus one new short user turn, as in a multi-turn chat, so earlier turns come from the cache. The
inline column is a direct HF encode of the rendered text on the calling thread, for reference.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sysconfig
import time
from pathlib import Path

import trio
from transformers import PreTrainedTokenizerBase

from tokenization.registry import DEFAULT_TOKENIZER_DIR, TokenizerRegistry, load_tokenizer
from tokenization.render import render_chat
from tokenization.service import TokenizerService

SIZES = (1_000, 8_000, 32_000)


def _corpus() -> str:
    """Local source text (the standard library), so that measuring needs no download."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:300]
    return "".join(path.read_text(encoding="utf-8", errors="replace") for path in files)


def _chat(text: str) -> dict:
    return {"messages": [{"role": "system", "content": "You are a careful code reviewer."},
                         {"role": "user", "content": text}]}


def _excerpt(hf: PreTrainedTokenizerBase, corpus: str, rnd: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of fresh text (cut by decoding; untimed setup)."""
    start = rnd.randrange(len(corpus) - tokens * 8)
    ids = hf.encode(corpus[start:start + tokens * 8], add_special_tokens=False)
    return hf.decode(ids[:tokens])


async def _measure(spec: str, workers: int, repeats: int) -> list[dict[str, float]]:
    corpus = _corpus()
    hf = load_tokenizer(spec)
    rnd = random.Random(7)
    rows = []
    async with TokenizerService.open(TokenizerRegistry(default=spec), workers=workers) as svc:
        for tokens in SIZES:
            cold, warm, inline, counted = [], [], [], 0
            for i in range(repeats):
                body = _chat(_excerpt(hf, corpus, rnd, tokens))
                started = time.perf_counter()
                counted = len(await svc.token_ids(None, body, "chat"))
                cold.append(time.perf_counter() - started)
                body["messages"] += [{"role": "assistant", "content": "Noted."},
                                     {"role": "user", "content": f"And line {i}?"}]
                started = time.perf_counter()
                await svc.token_ids(None, body, "chat")
                warm.append(time.perf_counter() - started)
                text = render_chat(hf, body)
                started = time.perf_counter()
                hf.encode(text + f"#{i}", add_special_tokens=False)
                inline.append(time.perf_counter() - started)
            rows.append({"tokens": counted, "cold_ms": statistics.median(cold) * 1e3,
                         "warm_ms": statistics.median(warm) * 1e3,
                         "inline_hf_ms": statistics.median(inline) * 1e3})
    return rows


def latency_table(spec: str | None = None, workers: int = 1, repeats: int = 5) -> list[dict[str, float]]:
    """Median latency (ms) of ``TokenizerService.token_ids`` per prompt size; runs its own trio loop."""
    return trio.run(_measure, spec or str(DEFAULT_TOKENIZER_DIR), workers, repeats)


def format_table(rows: list[dict[str, float]]) -> str:
    lines = [f"{'tokens':>8} {'cold ms':>9} {'warm ms':>9} {'inline HF ms':>13}"]
    for row in rows:
        lines.append(f"{row['tokens']:>8} {row['cold_ms']:>9.2f} {row['warm_ms']:>9.2f} "
                     f"{row['inline_hf_ms']:>13.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``kvmesh bench tokenize [--tokenizer SPEC] [--workers N] [--repeats N]``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer", default=None, help="HF folder or hub name (default: embedded)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(format_table(latency_table(args.tokenizer, args.workers, args.repeats)))
    return 0
