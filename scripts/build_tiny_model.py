"""Build the tiny random Qwen2 model that real vLLM engines serve in tests, without any download.

Run with the vLLM venv's python (it has torch and transformers). The model carries the router's embedded
tokenizer (``tokenization/default``), so the engine's ``/tokenize`` and the router's own rendering can be
compared token for token. The weights are random but seeded, so every build is the same model. The folder
is cached: a recipe file inside it records what was built, and a matching recipe makes this a no-op.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO / "tokenization" / "default"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TOKENIZER_SUBDIR = "tokenizer"
RECIPE_FILE = "kvmesh-recipe.json"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
SHAPE = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
}


def recipe(seed: int) -> dict[str, object]:
    """Everything that determines the built folder, including the tokenizer files' digest."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        digest.update((TOKENIZER_DIR / name).read_bytes())
    return {
        "seed": seed, "shape": SHAPE, "tokenizer_sha256": digest.hexdigest(), "dtype": "bfloat16",
        "tokenizer_subdir": TOKENIZER_SUBDIR,
    }


def copy_tokenizer(out: Path) -> dict[str, int]:
    """Copy the router's tokenizer files verbatim (the engine must tokenize exactly as the router does).

    They go into ``tokenizer/`` (what the engine loads through ``--tokenizer``) and, for peers that read
    ``tokenizer.json`` from the model path, into the model folder too. The engine must not load them from
    the model folder: next to a ``config.json`` with model_type qwen2, transformers 5 picks its
    Qwen2Tokenizer class, whose own pre-tokenizer regex and NFC normaliser split text (e.g. "\\r\\n ")
    differently from the router, which loads the folder without a model config.
    Returns the vocabulary, whose size and special ids the model config must match.
    """
    for folder in (out, out / TOKENIZER_SUBDIR):
        folder.mkdir(exist_ok=True)
        for name in TOKENIZER_FILES:
            shutil.copyfile(TOKENIZER_DIR / name, folder / name)
    return json.loads((TOKENIZER_DIR / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]


def save_model(out: Path, seed: int, vocab_size: int, eos_id: int, pad_id: int) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        **SHAPE,
    )
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out))
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=eos_id).save_pretrained(str(out))


def build(out: Path, seed: int) -> bool:
    """Build into ``out`` unless an identical build is there; return True when something was built."""
    want = recipe(seed)
    recipe_path = out / RECIPE_FILE
    if recipe_path.is_file() and json.loads(recipe_path.read_text()) == want:
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and swap it in, so a concurrent or interrupted run never leaves half a model.
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".tiny-model-") as tmp:
        staging = Path(tmp) / "model"
        staging.mkdir()
        vocab = copy_tokenizer(staging)
        save_model(staging, seed, vocab_size=len(vocab), eos_id=vocab[EOS_TOKEN], pad_id=vocab[PAD_TOKEN])
        (staging / RECIPE_FILE).write_text(json.dumps(want, indent=1, sort_keys=True))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    if build(args.out, args.seed):
        print(f"build_tiny_model: built {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
