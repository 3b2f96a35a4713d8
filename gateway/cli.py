"""``kvmesh`` command line: one entry point, a subcommand per role."""

from __future__ import annotations

import argparse
import importlib
import sys

from gateway.config import POLICIES, ConfigError, load_config

# Subcommands that live in other packages: name -> (module, help). Each module has main(argv) -> int.
DELEGATED = {
    "sim": ("sim.cli", "run simulated vLLM engines"),
    "bench": ("bench.cli", "benchmarks: overhead, routing, mesh, ..."),
    "up": ("cluster.cli", "start a local cluster (routers behind HAProxy, engines, Redis)"),
    "down": ("cluster.cli", "stop the local cluster started by 'kvmesh up'"),
    "status": ("cluster.cli", "show the local cluster started by 'kvmesh up'"),
    "demo": ("bench.demo", "start a local cluster, send a workload, print what happened"),
    "chaos": ("chaos.cli", "run a chaos scenario against the local cluster"),
    "keys": ("gateway.security.keys", "hash or generate API keys for the config file"),
}


def router_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh router", description="Run one kvmesh router replica.")
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--engine", action="append", default=[], metavar="URL",
                   help="engine base URL (repeatable; merged with the file's engines)")
    p.add_argument("--policy", choices=POLICIES)
    p.add_argument("--tokenizer", help="tokenizer folder or hub name for every model without its own")
    p.add_argument("--island", help="this router's topology island")
    p.add_argument("--log-level", dest="log_level", choices=("debug", "info", "warning", "error"))
    p.add_argument("--metrics-interval", dest="metrics_interval_s", type=float)
    p.add_argument("--tracing", dest="tracing_exporter", choices=("none", "console", "otlp"),
                   help="OpenTelemetry span exporter (default none)")
    p.add_argument("--mesh-bind", dest="mesh_bind", help="host:port for gossip (UDP)")
    p.add_argument("--mesh-advertise", dest="mesh_advertise", help="host:port peers use to reach this replica "
                   "(default: the bind address, or this host's address when binding 0.0.0.0)")
    p.add_argument("--seeds", dest="mesh_seeds", help="comma-separated gossip addresses of other replicas")
    p.add_argument("--mesh-secret-file", dest="mesh_secret_file")
    p.add_argument("--replication-bind", dest="mesh_replication_bind", help="host:port for index replication")
    p.add_argument("--redis-url", dest="mesh_redis_url")
    return p


def parse_router_args(argv: list[str]):
    args = router_parser().parse_args(argv)
    flat = {k: v for k, v in vars(args).items() if k not in ("config", "engine") and v is not None}
    cli: dict = {k: v for k, v in flat.items() if not k.startswith("mesh_")}
    mesh = {k[len("mesh_"):]: v for k, v in flat.items() if k.startswith("mesh_")}
    if mesh:
        cli["mesh"] = mesh
    if "tracing_exporter" in cli:
        cli["tracing"] = {"exporter": cli.pop("tracing_exporter")}
    return load_config(args.config, cli=cli, extra_engines=args.engine)


def run_router(argv: list[str]) -> int:
    try:
        config = parse_router_args(argv)
    except ConfigError as exc:
        print(f"kvmesh router: configuration error: {exc}", file=sys.stderr)
        return 2
    server = importlib.import_module("gateway.server")
    return server.main(config)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"router": "run one router replica", **{k: v[1] for k, v in DELEGATED.items()}}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: kvmesh COMMAND [ARGS]\n\ncommands:")
        for name, text in commands.items():
            print(f"  {name:8} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command == "router":
        return run_router(rest)
    module = importlib.import_module(DELEGATED[command][0])
    if command in ("up", "down", "status"):
        return module.main([command, *rest])
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
