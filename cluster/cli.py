"""``kvmesh up`` / ``down`` / ``status``: the local cluster from the command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster import daemon, haproxy
from cluster.daemon import StartError
from cluster.local import ClusterError, UpOptions, down, up
from cluster.state import DEFAULT_STATE_DIR, ClusterState, load
from gateway.config import POLICIES
from sim.profiles import PROFILES


def engines_arg(text: str) -> tuple[int, bool]:
    """``4`` -> 4 simulated engines, ``vllm:2`` -> 2 real vLLM engines."""
    kind, _, count = text.rpartition(":")
    if kind not in ("", "vllm", "sim") or not count.isdigit():
        raise argparse.ArgumentTypeError(f"expected N, sim:N or vllm:N, got {text!r}")
    return int(count), kind == "vllm"


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="kvmesh", description=__doc__)
    sub = root.add_subparsers(dest="command", required=True)
    p = sub.add_parser("up", help="start routers behind HAProxy, engines and optionally Redis")
    p.add_argument("--routers", type=int, default=3)
    p.add_argument("--engines", type=engines_arg, default=(4, False), help="N (simulated) or vllm:N")
    p.add_argument("--redis", action="store_true", help="start redis-server and give routers --redis-url")
    p.add_argument("--port", type=int, default=0, help="HAProxy's port (default: a free one)")
    p.add_argument("--policy", choices=POLICIES, default="kv_aware")
    p.add_argument("--no-mesh", dest="mesh", action="store_false", help="routers without gossip/replication")
    p.add_argument("--profile", choices=sorted(PROFILES), default="a40-qwen1.5b", help="simulated engines")
    p.add_argument("--time-scale", type=float, default=1.0, help="simulated engines")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait until all is healthy")
    p.add_argument("--standby", type=int, default=0, help="spare simulated engines the routers' autoscaler "
                   "provisions through a standby pool (0: no autoscaler)")
    p.add_argument("--auth", action="store_true", help="routers with auth: an admin key and tenants 'steady' and "
                   "'flood' (keys in STATE_DIR/keys.json)")
    p.add_argument("--status", action="store_true", help="show the running cluster instead of starting one")
    for name in ("down", "status"):
        sub.add_parser(name, help=f"{name} the local cluster").add_argument(
            "--state-dir", type=Path, default=Path(DEFAULT_STATE_DIR)
        )
    p.add_argument("--state-dir", type=Path, default=Path(DEFAULT_STATE_DIR))
    return root


def summary(state: ClusterState) -> str:
    """Who runs where, one line per process, HAProxy first."""
    meshed = "meshed" if state.meshed else "unmeshed"
    lines = [
        f"kvmesh cluster ({state.policy}, {meshed}) state {state.path}",
        f"  haproxy  {state.haproxy_url}   stats {state.stats_url}",
    ]
    for record in state.processes:
        if record.role != "haproxy":
            where = record.url or ""
            mark = "" if daemon.alive(record) else "  (not running)"
            lines.append(f"  {record.name:10} {where:28} pid {record.pid:<7} log {record.log}{mark}")
    return "\n".join(lines)


def status(state_dir: Path) -> int:
    try:
        state = load(state_dir.resolve())
    except FileNotFoundError:
        print(f"no cluster state in {state_dir}")
        return 1
    print(summary(state))
    try:
        backends = haproxy.server_states(state.stats_url)
        print("  haproxy backends: " + ", ".join(f"{k} {v}" for k, v in sorted(backends.items())))
    except OSError as exc:
        print(f"  haproxy stats unavailable: {exc}")
    return 0 if all(daemon.alive(p) for p in state.processes) else 1


def main(argv: list[str] | None) -> int:
    """``argv[0]`` is "up", "down" or "status"; returns the exit code."""
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "status" or (args.command == "up" and args.status):
        return status(args.state_dir)
    if args.command == "down":
        try:
            survivors = down(args.state_dir)
        except FileNotFoundError:
            print(f"no cluster state in {args.state_dir}; nothing to stop")
            return 0
        except ValueError as exc:
            print(f"kvmesh down: {exc}", file=sys.stderr)
            return 1
        if survivors:
            names = ", ".join(f"{r.name} (pid {r.pid})" for r in survivors)
            print(f"still running: {names}", file=sys.stderr)
            return 1
        print("kvmesh cluster stopped")
        return 0
    count, vllm = args.engines
    options = UpOptions(
        routers=args.routers,
        engines=count,
        vllm=vllm,
        redis=args.redis,
        port=args.port,
        state_dir=args.state_dir,
        policy=args.policy,
        mesh=args.mesh,
        profile=args.profile,
        time_scale=args.time_scale,
        timeout=args.timeout,
        standby=args.standby,
        auth=args.auth,
    )
    try:
        state = up(options)
    except (ClusterError, StartError, ValueError, OSError) as exc:
        print(f"kvmesh up: {exc}", file=sys.stderr)
        return 1
    print(summary(state))
    return 0


if __name__ == "__main__":
    sys.exit(main(None))
