"""A LoRA adapter for the tiny test model, written at test time (no download, no peft): PEFT's file layout.

Rank 8 on every layer's q_proj and v_proj, random weights (seeded): what vLLM needs to load and serve an
adapter; its answers do not matter, its KV blocks do.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

RANK = 8


def build_tiny_lora(model: Path, out: Path, seed: int = 0) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` for ``model`` into ``out``."""
    config = json.loads((model / "config.json").read_text())
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    outputs = {"q_proj": config["num_attention_heads"] * head_dim, "v_proj": config["num_key_value_heads"] * head_dim}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, width in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.02, (RANK, hidden)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.02, (width, RANK)).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK, "lora_dropout": 0.0,
        "target_modules": sorted(outputs), "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
        "base_model_name_or_path": str(model)}))
    return out
