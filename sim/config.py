"""Configuration of a simulated fleet and of each engine in it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from sim.event_encoding import Encoding
from sim.profiles import DEFAULT_PROFILE
from tokenization.registry import DEFAULT_TOKENIZER_DIR


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One engine. Port 0 means "any free port" (the bound port is reported once started)."""

    index: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    event_port: int = 0
    replay_port: int = 0
    model: str = "kvmesh-tiny"
    tokenizer: str = str(DEFAULT_TOKENIZER_DIR)
    block_size: int = 16
    num_blocks: int = 4096
    max_num_seqs: int = 256
    profile: str = DEFAULT_PROFILE
    time_scale: float = 1.0
    event_encoding: Encoding = "map"
    events: bool = True
    topic: str = "kv"
    hash_seed: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    keep_alive_s: float = 5.0
    keep_alive_race_s: float = 0.0
    """Requests on a reused connection arriving this close to the keep-alive close lose the race to it."""
    role: str = "both"
    """prefill | decode | both: the engine's side of a disaggregated pair (sim/roles.py)."""
    kv_lease_s: float = 30.0
    """How long a prefill engine holds handed-over blocks (vLLM's ``kv_lease_duration``)."""
    kv_shared_path: str | None = None
    """A folder shared with other engines, as ExampleConnector's ``shared_storage_path``: the engine stores the
    prompts it computes there and loads those it finds (sim/shared_storage.py); it then plays no handoff."""
    server_dev_mode: bool = False
    """Serve vLLM's development endpoints (``VLLM_SERVER_DEV_MODE=1``): ``/server_info`` names the connector
    and its role; without it the engine answers 404 there, as vLLM does."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """LoRA adapters served beside the base model, as vLLM's ``--lora-modules name=path``: requests naming one
    are keyed with it (events and block hashes) and it is listed in /v1/models with the base as parent."""
    max_loras: int = 1
    lora_load_s: float = 0.01
    """LoRA slots (vLLM's ``--max-loras``, default 1) and what loading an adapter into one costs."""
    cpu_blocks: int = 0
    """Blocks of the optional CPU tier (sim/cpu_tier.py); 0: none, as vLLM without an offloading connector."""
    cpu_bandwidth_gbps: float = 20.0
    kv_bytes_per_token: int = 131_072
    """With the bandwidth, what loading a block back from the CPU tier costs (defaults: an 8B-class model in
    bf16 over PCIe 4.0, as the router's own tier defaults)."""
    media: tuple[tuple[str, int, int], ...] = ()
    """Media the model takes: (modality, placeholder token id, tokens per item), as a real model's processor
    fixes them (sim/media.py); none: image and audio parts are refused, as by a text-only model."""
    stream_interval: int = 1
    """Tokens per streamed event, as vLLM's ``--stream-interval``: the first and the last token go out at
    once, the others in groups of this many (speculative decoding also puts several tokens in one event)."""


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """N engines in one process: engine i listens on base_port+i, events on event_base_port+i and
    replay on replay_base_port+i (defaults base+1000+i and base+2000+i); base_port 0 = all free ports."""

    engines: int = 1
    base_port: int = 0
    event_base_port: int | None = None
    replay_base_port: int | None = None
    engine: EngineConfig = EngineConfig()
    roles: tuple[str, ...] = ()
    """One role for every engine, or one per engine (empty: the engine config's)."""

    def _role(self, i: int) -> str:
        return self.roles[i % len(self.roles)] if self.roles else self.engine.role

    def engine_configs(self) -> list[EngineConfig]:
        if self.base_port == 0:
            return [replace(self.engine, index=i, port=0, event_port=0, replay_port=0, role=self._role(i))
                    for i in range(self.engines)]
        ev = self.event_base_port if self.event_base_port is not None else self.base_port + 1000
        rp = self.replay_base_port if self.replay_base_port is not None else self.base_port + 2000
        return [replace(self.engine, index=i, port=self.base_port + i, event_port=ev + i, replay_port=rp + i,
                        role=self._role(i)) for i in range(self.engines)]

