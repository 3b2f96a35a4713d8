"""Segment splitting is exact for the embedded tokenizer and detected as unsafe where it is not."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer
from transformers import PreTrainedTokenizerFast

from tokenization.build_default import CHATML_TEMPLATE
from tokenization.cache import TokenCache
from tokenization.registry import DEFAULT_TOKENIZER_DIR, LoadedTokenizer, encode_plain, load_tokenizer

DEFAULT = LoadedTokenizer.load(str(DEFAULT_TOKENIZER_DIR))
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def build_lstrip_tokenizer(out: Path) -> str:
    """The embedded tokenizer, but ``<|im_start|>`` swallows whitespace before it (lstrip)."""
    tok = Tokenizer.from_file(str(DEFAULT_TOKENIZER_DIR / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|im_start|>", lstrip=True, special=True, normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out))
    return str(out)


def test_embedded_tokenizer_is_segmentable_without_affixes() -> None:
    assert DEFAULT.plan.segmentable
    assert DEFAULT.plan.affixes == ((), ())
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert DEFAULT.plan.split(text) == ["<|im_start|>user\nhi", "<|im_end|>\n", "<|im_start|>assistant\n"]


pieces = st.lists(st.one_of(st.sampled_from(SPECIALS), st.text(max_size=12),
                            st.sampled_from([" ", "\n", "\n\n", "  x", "é😀"])), max_size=12)


@settings(max_examples=200, deadline=None)
@given(parts=pieces)
def test_segments_concatenate_to_whole_text_ids(parts: list[str]) -> None:
    text = "".join(parts)
    segments = DEFAULT.plan.split(text)
    assert "".join(segments) == text
    whole, *encoded = encode_plain(DEFAULT.hf, [text, *segments])
    assert [t for ids in encoded for t in ids] == whole


@settings(max_examples=200, deadline=None)
@given(parts=pieces)
def test_plain_ids_from_the_rust_backend_equal_the_hf_call(parts: list[str]) -> None:
    texts = ["".join(parts), *parts]
    expected = DEFAULT.hf(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    assert encode_plain(DEFAULT.hf, texts) == [list(ids) for ids in expected]
    assert encode_plain(DEFAULT.hf, texts, in_thread=True) == [list(ids) for ids in expected]


def test_plain_ids_ignore_truncation_the_tokenizer_file_switches_on(tmp_path: Path) -> None:
    tok = Tokenizer.from_file(str(DEFAULT_TOKENIZER_DIR / "tokenizer.json"))
    tok.enable_truncation(max_length=4)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    text = "a sentence long enough to pass four tokens by a wide margin"
    assert len(encode_plain(fast, [text])[0]) == len(DEFAULT.hf.encode(text, add_special_tokens=False)) > 4


def test_lstrip_special_token_disables_segments(tmp_path: Path) -> None:
    loaded = LoadedTokenizer.load(build_lstrip_tokenizer(tmp_path / "lstrip"))
    assert not loaded.plan.segmentable
    text = "a<|im_end|>\n<|im_start|>b"
    assert loaded.plan.split(text) == [text]
    assert load_tokenizer(str(DEFAULT_TOKENIZER_DIR)).encode(text) != loaded.hf.encode(text)


def test_cache_evicts_least_recently_used_by_tokens() -> None:
    cache = TokenCache(capacity=10)
    cache.put("t", "a", (1, 2, 3, 4))
    cache.put("t", "b", (5, 6, 7, 8))
    assert cache.get("t", "a") == (1, 2, 3, 4)
    cache.put("t", "c", (9, 10, 11))
    assert cache.get("t", "b") is None
    assert cache.get("t", "a") == (1, 2, 3, 4)
    assert cache.get("u", "a") is None
    assert cache.tokens == 7
    cache.put("t", "huge", tuple(range(11)))
    assert cache.stats.rejected == 1 and cache.get("t", "huge") is None
    cache.clear("t")
    assert len(cache) == 0 and cache.tokens == 0


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(0, 40),
       ops=st.lists(st.tuples(st.sampled_from(["x", "y"]), st.sampled_from("abcdef")), max_size=60))
def test_cache_never_exceeds_budget_and_returns_stored(capacity: int, ops: list[tuple[str, str]]) -> None:
    cache = TokenCache(capacity)
    for tokenizer_id, text in ops:
        size = "abcdef".index(text) * 3
        ids = tuple(range(size))
        cache.put(tokenizer_id, text, ids)
        assert cache.tokens <= capacity
        if max(size, 1) <= capacity:
            assert cache.get(tokenizer_id, text) == ids
        else:
            assert cache.get(tokenizer_id, text) is None


def test_negative_capacity_is_rejected() -> None:
    with pytest.raises(ValueError):
        TokenCache(-1)
