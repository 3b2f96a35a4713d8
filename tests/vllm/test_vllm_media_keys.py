"""vLLM's own block hasher and event keys, read from its installed source and run on a duck-typed request with
multimodal items, LoRA and a salt, agree with the router's (index/vllm_hash.py, index/media_keys.py)."""

import ast
import bisect
import hashlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.vllm_engine import VLLM_VENV
from index.media_keys import MediaSpan, block_media
from index.vllm_hash import BlockHasher, none_hash, salt_extra_keys, sha256_pickle

pytestmark = pytest.mark.vllm

BS = 4
PROMPT = list(range(100, 122))  # 5 full blocks of 4 and 2 tokens more
SPANS = (MediaSpan("img-a", 2, 7), MediaSpan("img-b", 9, 3), MediaSpan("aud", 16, 2))


def _vllm_sources() -> tuple[str, str]:
    """vLLM's installed sources (the ``vllm_model`` fixture installs vLLM beside the repository first)."""
    [pkg] = sorted(VLLM_VENV.glob("lib/python*/site-packages/vllm"))[-1:]
    return (pkg / "v1/core/kv_cache_utils.py").read_text(), (pkg / "multimodal/utils.py").read_text()


def _functions(source: str, names: set[str]) -> str:
    tree = ast.parse(source)
    return "\n\n".join(ast.get_source_segment(source, node) for node in tree.body
                       if isinstance(node, ast.FunctionDef) and node.name in names)


def test_vllms_own_block_hasher_and_event_keys_agree_with_ours(vllm_model: Path) -> None:
    """vLLM's functions, read from its installed source and run on a duck-typed request: importing vLLM takes
    ~13 s, executing these few functions milliseconds."""
    cache_utils, mm_utils = _vllm_sources()
    code = "from __future__ import annotations\n" + _functions(mm_utils, {"get_mm_features_in_window"}) + "\n\n" + \
        _functions(cache_utils, {"_gen_mm_extra_hash_keys", "_gen_lora_extra_hash_keys",
                                 "_gen_prompt_embeds_extra_hash_keys", "generate_block_hash_extra_keys",
                                 "to_event_extra_keys", "hash_block_tokens", "get_request_block_hasher"})
    space = {"bisect": bisect, "hashlib": hashlib, "Any": Any, "Callable": Callable, "Iterable": Iterable,
             "Sequence": Sequence, "BlockHash": bytes, "NONE_HASH": none_hash("seed")}
    exec(compile(code, "vllm-kv_cache_utils", "exec"), space)  # noqa: S102 - vLLM's own code, read from disk
    for salt, lora in ((None, None), ("t", SimpleNamespace(lora_name="sql", lora_path="/a"))):
        features = [SimpleNamespace(identifier=s.identifier, mm_position=SimpleNamespace(offset=s.offset,
                                                                                           length=s.length))
                    for s in SPANS]
        request = SimpleNamespace(block_hashes=[], num_tokens=len(PROMPT), all_token_ids=PROMPT,
                                  mm_features=features, lora_request=lora, cache_salt=salt, prompt_embeds=None)
        theirs = space["get_request_block_hasher"](BS, sha256_pickle)(request)
        ours = BlockHasher(BS, salt, "seed", None if lora is None else ("sql", "/a"), SPANS)
        ours.extend(PROMPT)
        assert theirs == ours.hashes
        keys = [space["generate_block_hash_extra_keys"](request, i * BS, (i + 1) * BS, 0)[0] for i in range(5)]
        events = space["to_event_extra_keys"](keys)
        assert events == [salt_extra_keys(i, salt, None if lora is None else ("sql", "/a"),
                                          block_media(SPANS, i, BS)) for i in range(5)]
