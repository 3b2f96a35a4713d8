"""A cheap lower bound on a prompt's token count, so a prompt that cannot fit is refused without encoding it.

Two facts about a tokenizer bound the count from below without running it (sans-IO, microseconds to a
few milliseconds per megabyte):

- no token covers more characters than the longest vocabulary entry (byte-level entries hold one
  character per byte), so N characters need at least N / longest tokens;
- tokenizers whose pre-tokenizer splits at whitespace (GPT-2, Llama 3, Qwen, SentencePiece with
  whitespace splitting) never produce a token spanning two words, so a text has at least as many tokens
  as whitespace-separated words. Whether a tokenizer does is probed once at load (``splits_at_whitespace``).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from itertools import product

from transformers import PreTrainedTokenizerBase

UNSPLIT_SEPARATORS = "\x1c\x1d\x1e\x1f"
"""Python's ``str.split`` separates words here, tokenizers' regexes (Unicode White_Space) do not."""
_SEPARATORS = [c for c in map(chr, range(0x3001)) if c.isspace() and c not in UNSPLIT_SEPARATORS]
_PROBE_WORDS = ["".join(p) for p in product("qz", string.ascii_lowercase, "xy")][: len(_SEPARATORS) + 1]


def splits_at_whitespace(tokenizer: PreTrainedTokenizerBase) -> bool:
    """True when the tokenizer's pre-tokenizer puts words separated by any whitespace ``str.split`` knows
    (but ``UNSPLIT_SEPARATORS``) into different pieces, so no token can span two words."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pre = getattr(backend, "pre_tokenizer", None)
    if pre is None:
        return False
    probe = _PROBE_WORDS[0] + "".join(sep + word for sep, word in zip(_SEPARATORS, _PROBE_WORDS[1:], strict=True))
    normalizer = getattr(backend, "normalizer", None)
    if normalizer is not None:
        probe = normalizer.normalize_str(probe)
    pieces = [piece for piece, _ in pre.pre_tokenize_str(probe)]
    return all(sum(word in piece for word in _PROBE_WORDS) <= 1 for piece in pieces)


_ASCII_SEPARATORS = bytes(c for c in range(128) if chr(c).isspace())
"""Everything ``str.split`` separates ASCII words at."""


def most_words(text: str) -> int:
    """At most how many words ``str.split`` finds in ``text``, without splitting it: in ASCII text one more than
    its separators (counted in one pass in C: 7.5 us for 15k characters where splitting took 57), otherwise one
    per two characters."""
    if text.isascii():
        data = text.encode("ascii")
        return 1 + len(data) - len(data.translate(None, _ASCII_SEPARATORS))
    return (len(text) + 1) // 2


def fewest_tokens(texts: Sequence[str], longest_token: int, split_words: bool, above: int) -> int:
    """At least how many tokens ``texts`` take once joined into one prompt (a template may glue the last
    word of one to the first of the next, hence one word less per join). Words are counted only when they
    could pass ``above`` (``most_words``), and counting stops once they do, so a huge prompt costs a scan of
    its first ``above`` words only; below ``above`` the bound may be the characters' alone (the word scan took
    74 us of a 15k-character conversation's bound in a loop, where this check takes 12)."""
    chars = sum(map(len, texts))
    by_chars = -(-chars // max(longest_token, 1))
    if by_chars > above or chars <= above or not split_words:
        return by_chars
    if 1 - len(texts) + sum(map(most_words, texts)) <= above:
        return by_chars
    words = 1 - len(texts)
    for text in texts:
        if any(sep in text for sep in UNSPLIT_SEPARATORS):
            words += 1
            continue
        words += len(text.split(maxsplit=above + 1))
        if words > above:
            break
    return max(by_chars, words)
