"""The router's and the simulated engines' encodes run on the calling thread: no tokenizer thread pool."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import os, sys
from tokenization.registry import DEFAULT_TOKENIZER_DIR, LoadedTokenizer, encodes_on_the_calling_thread, plain_backend
encodes_on_the_calling_thread()
tok = LoadedTokenizer.load(str(DEFAULT_TOKENIZER_DIR))
plain_backend(tok.hf).encode_batch_fast([f"segment {i} " * 40 for i in range(64)], add_special_tokens=False)
print(len(os.listdir("/proc/self/task")))
"""


def threads_after_a_batch_encode(parallelism: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    if parallelism is not None:
        env["TOKENIZERS_PARALLELISM"] = parallelism
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def test_a_batch_encode_starts_no_thread_pool_unless_the_operator_asks_for_one():
    """Loading the tokenizer (its checks encode batches) and a 64-text batch encode leave no pool threads behind;
    an explicit ``TOKENIZERS_PARALLELISM=true`` is kept, and then the pool's threads appear."""
    assert threads_after_a_batch_encode(None) < threads_after_a_batch_encode("true")
