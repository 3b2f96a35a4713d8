"""`kvmesh sim`: run a fleet of simulated vLLM engines in this process until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from dataclasses import replace

import trio
import zmq

from sim.config import EngineConfig, FleetConfig
from sim.fleet import describe, run_fleet
from sim.media import parse_placeholder
from sim.profiles import DEFAULT_PROFILE, PROFILES
from sim.roles import ROLES
from tokenization.registry import DEFAULT_TOKENIZER_DIR, encodes_on_the_calling_thread

READY_PREFIX = "KVMESH_SIM_READY "


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh sim", description=__doc__)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--base-port", type=int, default=8100, help="engine i serves HTTP on base+i; 0 = free ports")
    p.add_argument("--event-base-port", type=int, default=None, help="default base+1000")
    p.add_argument("--replay-base-port", type=int, default=None, help="default base+2000")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model", default="kvmesh-tiny", help="served model name")
    p.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER_DIR), help="Hugging Face tokenizer folder")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=4096, help="KV capacity per engine (incl. null block)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                   help="LoRA adapters served beside the base model, as vLLM's flag")
    p.add_argument("--max-loras", type=int, default=1, help="LoRA slots: adapters batched together")
    p.add_argument("--lora-load-s", type=float, default=0.01, help="loading an adapter into a slot, seconds")
    p.add_argument("--mm-placeholder", nargs="+", action="extend", default=[], metavar="MODALITY=ID:TOKENS",
                   help="media the model takes: image or audio, its placeholder token and tokens per item")
    p.add_argument("--cpu-blocks", type=int, default=0, help="blocks of a CPU offload tier (0: none)")
    p.add_argument("--cpu-bandwidth-gbps", type=float, default=20.0, help="CPU tier -> KV cache copy speed")
    p.add_argument("--kv-bytes-per-token", type=int, default=131_072, help="KV bytes per token (tier load time)")
    p.add_argument("--profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE)
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply every modelled duration")
    p.add_argument("--event-encoding", choices=["map", "array"], default="map")
    p.add_argument("--no-events", action="store_true")
    p.add_argument("--topic", default="kv")
    p.add_argument("--seed-hash", default=None, help="NONE_HASH seed like PYTHONHASHSEED (default: env or "
                   "vLLM's 'vllm-none-hash')")
    p.add_argument("--buffer-steps", type=int, default=10_000)
    p.add_argument("--keep-alive", type=float, default=5.0, help="idle keep-alive timeout, seconds (uvicorn's)")
    p.add_argument("--keep-alive-race", type=float, default=0.0,
                   help="a request on a reused connection arriving this long before the keep-alive close is "
                        "reset, as when it races uvicorn's close")
    p.add_argument("--role", default="both", help="prefill | decode | both, or one per engine, comma-separated: "
                   "a prefill engine answers a handoff request with kv_transfer_params, a decode engine loads them")
    p.add_argument("--kv-lease", type=float, default=30.0, help="seconds a prefill engine holds handed-over blocks")
    p.add_argument("--kv-shared-path", default=None,
                   help="run ExampleConnector's protocol over this shared folder (its shared_storage_path): "
                        "every engine stores the prompts it computes there and loads those it finds")
    p.add_argument("--server-dev-mode", action="store_true",
                   help="serve vLLM's development endpoints (VLLM_SERVER_DEV_MODE=1): /server_info")
    p.add_argument("--log-level", default="WARNING")
    return p


def config_from_args(args: argparse.Namespace) -> FleetConfig:
    if args.engines < 1 or args.block_size < 1 or args.num_blocks < 2 or args.max_num_seqs < 1:
        raise ValueError("engines, block size and max-num-seqs must be >= 1, num-blocks >= 2")
    adapters = tuple(tuple(item.split("=", 1)) for item in args.lora_modules)
    if any(len(a) != 2 or not all(a) for a in adapters):
        raise ValueError("lora-modules take NAME=PATH")
    if args.max_loras < 1 or args.lora_load_s < 0:
        raise ValueError("max-loras must be >= 1 and lora-load-s not negative")
    if args.cpu_blocks < 0 or args.cpu_bandwidth_gbps <= 0 or args.kv_bytes_per_token < 1:
        raise ValueError("cpu-blocks must be >= 0, cpu-bandwidth-gbps and kv-bytes-per-token positive")
    media = tuple(parse_placeholder(item) for item in args.mm_placeholder)
    if args.time_scale <= 0:
        raise ValueError("time-scale must be positive")
    if args.keep_alive <= 0 or args.keep_alive_race < 0:
        raise ValueError("keep-alive must be positive and keep-alive-race not negative")
    engine = EngineConfig(
        host=args.host, model=args.model, tokenizer=args.tokenizer, block_size=args.block_size,
        num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs, profile=args.profile,
        time_scale=args.time_scale, event_encoding=args.event_encoding, events=not args.no_events,
        topic=args.topic, hash_seed=args.seed_hash, buffer_steps=args.buffer_steps,
        keep_alive_s=args.keep_alive, keep_alive_race_s=args.keep_alive_race, cpu_blocks=args.cpu_blocks,
        cpu_bandwidth_gbps=args.cpu_bandwidth_gbps, kv_bytes_per_token=args.kv_bytes_per_token,
        lora_modules=adapters, max_loras=args.max_loras, lora_load_s=args.lora_load_s, media=media,
    )
    roles = [r.strip() for r in args.role.split(",")]
    if any(r not in ROLES for r in roles) or len(roles) not in (1, args.engines):
        raise ValueError(f"role must be one of {', '.join(ROLES)}, once or once per engine")
    if args.kv_lease <= 0:
        raise ValueError("kv-lease must be positive")
    engine = replace(engine, kv_lease_s=args.kv_lease, kv_shared_path=args.kv_shared_path,
                     server_dev_mode=args.server_dev_mode)
    return FleetConfig(engines=args.engines, base_port=args.base_port, event_base_port=args.event_base_port,
                       replay_base_port=args.replay_base_port, engine=engine, roles=tuple(roles))


async def run(config: FleetConfig) -> None:
    """Run the fleet; print one ready line (JSON list of engines) on stdout; stop on SIGINT/SIGTERM."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            engines = await nursery.start(run_fleet, config)
            print(READY_PREFIX + json.dumps(describe([e.info for e in engines])), flush=True)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    encodes_on_the_calling_thread()
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"kvmesh sim: {exc}", file=sys.stderr)
        return 2
    try:
        trio.run(run, config)
    except (OSError, zmq.ZMQError) as exc:
        print(f"kvmesh sim: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
