"""LoRA adapters: which base model and adapter a request's blocks are keyed under.

vLLM keys an adapter request's blocks with the adapter (its name in ``lora_name`` and the events'
``extra_keys``, name and path in the hash), under the engine's base model; the router's index seeds such
chains with ``root_seed(base, adapter, salt)`` (index/block_hash.py). A request names the adapter as its
``model``: the engines listing it in ``/v1/models`` say which base it belongs to.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.engines import EngineLoad, EngineState


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


def adapter_terms(adapter: str | None, load: EngineLoad, load_s: float) -> tuple[float, bool]:
    """(adapter load to charge, whether every LoRA slot is held by other adapters) for a request of ``adapter``
    on an engine: nothing for a base-model request, an adapter already running, or an engine that reports no
    LoRA slots (it loads adapters no router can see)."""
    if adapter is None or load.max_lora is None or adapter in load.running_adapters:
        return 0.0, False
    return load_s, len(load.running_adapters) >= load.max_lora
