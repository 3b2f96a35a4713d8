"""LoRA adapters: which base model and adapter a request's blocks are keyed under.

vLLM keys an adapter request's blocks with the adapter (its name in ``lora_name`` and the events'
``extra_keys``, name and path in the hash), under the engine's base model; the router's index seeds such
chains with ``root_seed(base, adapter, salt)`` (index/block_hash.py). A request names the adapter as its
``model``: the engines listing it in ``/v1/models`` say which base it belongs to.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.engines import EngineState


def base_model(engine: EngineState) -> str:
    """The engine's base model: what its events are keyed under (never one of its adapters)."""
    bases = sorted(engine.models - engine.adapters.keys())
    return bases[0] if bases else ""


def chain_model(model: str, engines: Iterable[EngineState]) -> tuple[str, str | None]:
    """(base model, adapter) a request for ``model`` is keyed under on these engines: (model, None) unless an
    engine serves ``model`` as an adapter."""
    for engine in engines:
        base = engine.adapters.get(model)
        if base is not None:
            return base, model
    return model, None
