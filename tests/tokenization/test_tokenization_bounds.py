"""The lower bound on a prompt's token count never exceeds the real count, and refuses huge prompts cheaply."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenization.bounds import UNSPLIT_SEPARATORS, fewest_tokens, splits_at_whitespace
from tokenization.registry import DEFAULT_TOKENIZER_DIR, LoadedTokenizer

TOKENIZER = LoadedTokenizer.load(str(DEFAULT_TOKENIZER_DIR))
ALPHABET = st.sampled_from(list("ab é😀\t\n\r.,;'-_0123") + ["\xa0", "\u3000", "\u2028", "\x85", *UNSPLIT_SEPARATORS])


def test_the_embedded_byte_level_tokenizer_splits_words():
    assert TOKENIZER.splits_words and TOKENIZER.longest_token > 1


def test_a_tokenizer_without_a_pre_tokenizer_is_not_trusted_to_split():
    class Opaque:
        backend_tokenizer = None

    assert not splits_at_whitespace(Opaque())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(ALPHABET, max_size=60), min_size=1, max_size=4), st.integers(0, 40))
def test_the_bound_never_exceeds_the_real_count_of_the_joined_texts(texts, above):
    joined = "".join(texts)
    real = len(TOKENIZER.hf.encode(joined, add_special_tokens=False))
    assert TOKENIZER.fewest_tokens(texts, above) <= real


def test_a_megabyte_of_words_passes_any_context_even_with_long_tokens():
    text = "word " * (1024 * 1024 // 5)
    started = time.perf_counter()
    fewest = fewest_tokens([text], longest_token=256, split_words=True, above=32_768)
    print(f"bound for 1 MB with 32k context: {(time.perf_counter() - started) * 1000:.1f} ms")
    assert fewest > 32_768
    assert fewest_tokens([text], longest_token=256, split_words=False, above=32_768) == -(-len(text) // 256)
    assert fewest_tokens(["=" * 1_000_000], longest_token=64, split_words=True, above=32_768) == 15_625


@settings(max_examples=300, deadline=None)
@given(st.text(ALPHABET, max_size=80))
def test_most_words_is_never_below_what_split_finds(text):
    from tokenization.bounds import most_words

    assert most_words(text) >= len(text.split())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(ALPHABET, max_size=60), min_size=1, max_size=4), st.integers(0, 120))
def test_skipping_the_word_scan_never_changes_whether_a_prompt_passes_the_context(texts, above):
    """The refusal compares the bound with ``above``: skipping the scan below it must decide alike."""
    fewest = fewest_tokens(texts, longest_token=4, split_words=True, above=above)
    words = 1 - len(texts) + sum(1 if any(c in t for c in UNSPLIT_SEPARATORS) else len(t.split()) for t in texts)
    by_chars = -(-sum(map(len, texts)) // 4)
    assert (fewest > above) == (max(by_chars, words) > above)
