"""Split prompt text where a tokenizer cannot merge across, so segments can be tokenized (and cached) alone.

HF tokenizers cut added tokens such as ``<|im_start|>`` out of the text before any merging, so the
text between two of them is tokenized on its own. Splitting just before every added token therefore
usually gives segments whose token ids concatenate to the ids of the whole text, and a chat template
puts such tokens at every message boundary: system prompts, tool schemas and earlier turns become
reusable segments. Options such as ``lstrip`` on an added token or a position-dependent pre-tokenizer
break this, so each tokenizer is checked on probe texts before segments are trusted (and the service
keeps re-checking on real traffic).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BatchEncoder = Callable[[Sequence[str]], list[list[int]]]
"""Encodes texts without adding special tokens (``add_special_tokens=False``)."""

PROBE_TEXT = "a b"


@dataclass(frozen=True)
class SegmentPlan:
    """How one tokenizer's prompts may be split, and the ids it adds around a prompt."""

    pattern: re.Pattern[str] | None
    """Matches added tokens; None when the tokenizer has none (one segment per prompt)."""
    segmentable: bool
    """Segments concatenate to the whole on every probe."""
    affixes: tuple[tuple[int, ...], tuple[int, ...]] | None
    """Ids added before and after a prompt when ``add_special_tokens`` is true; None if not separable."""

    def split(self, text: str) -> list[str]:
        """Cut ``text`` just before each added token; the pieces join back to ``text``."""
        if self.pattern is None or not self.segmentable:
            return [text]
        cuts = [m.start() for m in self.pattern.finditer(text) if m.start() > 0]
        bounds = [0, *cuts, len(text)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def added_token_pattern(added_tokens: Sequence[str]) -> re.Pattern[str] | None:
    """A regex for the added tokens, longest first so that one token's prefix never wins."""
    tokens = sorted({t for t in added_tokens if t}, key=len, reverse=True)
    if not tokens:
        return None
    return re.compile("|".join(map(re.escape, tokens)))


def probe_texts(added_tokens: Sequence[str], rendered: Sequence[str]) -> list[str]:
    """Texts that exercise boundaries: added tokens next to spaces, newlines, text and each other."""
    tokens = sorted(set(added_tokens))[:8]
    probes = list(rendered)
    for i, tok in enumerate(tokens):
        other = tokens[(i + 1) % len(tokens)]
        probes += [f"{tok}x", f"x {tok} y", f"x\n\n{tok}\n\ny  ", f" {tok}{other}\n", f"é😀 {tok}\t{other} z"]
    return probes


def independent(split: Callable[[str], list[str]], encode: BatchEncoder, texts: Sequence[str]) -> bool:
    """True when, for every text, the segments' ids concatenated equal the whole text's ids."""
    for text in texts:
        pieces = split(text)
        whole, *parts = encode([text, *pieces])
        if [t for part in parts for t in part] != whole:
            return False
    return True


def special_affixes(encode_with: Callable[[str], list[int]], encode: BatchEncoder,
                    texts: Sequence[str]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The ids ``add_special_tokens=True`` puts around a prompt (BOS, EOS...), if constant on all texts."""
    plain = encode([PROBE_TEXT])[0]
    full = encode_with(PROBE_TEXT)
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            prefix, suffix = tuple(full[:start]), tuple(full[start + len(plain):])
            break
    else:
        return None
    for text, ids in zip(texts, encode(texts), strict=True):
        if [*prefix, *ids, *suffix] != encode_with(text):
            return None
    return prefix, suffix


def plan(added_tokens: Sequence[str], encode: BatchEncoder, encode_with: Callable[[str], list[int]],
         rendered: Sequence[str]) -> SegmentPlan:
    """Check a tokenizer once and return how its prompts may be split."""
    probes = probe_texts(added_tokens, rendered)
    candidate = SegmentPlan(added_token_pattern(added_tokens), True, None)
    ok = independent(candidate.split, encode, probes)
    return SegmentPlan(candidate.pattern, ok, special_affixes(encode_with, encode, probes))
