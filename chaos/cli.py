"""``kvmesh chaos SCENARIO --duration S --report FILE.json``: break the local cluster under load, check
that it stays correct and recovers, write the report. Exit 0 when every invariant held, 1 otherwise."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import trio

from chaos import report
from chaos.runner import ChaosOptions, run_chaos
from chaos.scenarios import HOLDER_FAULT_S, HOLDER_FAULTS, SCENARIOS
from cluster.state import DEFAULT_STATE_DIR, load


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh chaos", description=__doc__)
    p.add_argument("scenario", choices=SCENARIOS)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (stretched to observe the last heal)")
    p.add_argument("--report", type=Path, default=Path("chaos-report.json"), help="JSON path; markdown beside it")
    p.add_argument("--state-dir", type=Path, default=Path(DEFAULT_STATE_DIR), help="where 'kvmesh up' wrote its state")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second through HAProxy")
    p.add_argument("--fault-seconds", type=float, default=None, help="how long each fault lasts before it heals "
                   f"(default 2; {HOLDER_FAULT_S:g} for partition-kill-holder, whose heal is the kill)")
    p.add_argument("--flood-rate", type=float, default=1.0, help="partition-kill-holder: long prompts per second "
                   "from the flooding tenant while the partition lasts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--interval", type=float, default=0.5, help="monitor sampling interval, seconds")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        state = load(args.state_dir.resolve())
    except FileNotFoundError:
        print(f"kvmesh chaos: no cluster state in {args.state_dir}; run 'kvmesh up' first", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"kvmesh chaos: {exc}", file=sys.stderr)
        return 2
    fault_s = args.fault_seconds or (HOLDER_FAULT_S if args.scenario in HOLDER_FAULTS else 2.0)
    options = ChaosOptions(args.scenario, args.duration, args.rate, args.seed, fault_s, args.interval,
                           flood_rate=args.flood_rate)
    try:
        run = trio.run(run_chaos, state, options)
    except (ValueError, OSError) as exc:
        print(f"kvmesh chaos: {exc}", file=sys.stderr)
        return 2
    data = report.build(run)
    json_path, md_path = report.write(data, args.report)
    failed = [name for name, held in data["invariants"].items() if not held]
    req = data["requests"]
    print(f"kvmesh chaos {args.scenario}: {req['total']} requests, {req['ok']} ok, {req['failed']} failed; "
          f"{'all invariants held' if not failed else 'FAILED: ' + ', '.join(failed)}")
    for name, held in data["invariants"].items():
        print(f"  {'held  ' if held else 'FAILED'}  {name}")
    if data["failures_by_cause"]:
        print("failures by cause: " + ", ".join(f"{c} {n}" for c, n in sorted(data["failures_by_cause"].items())))
    print(report.continuation_line(data))
    if data["autoscaler"]:
        print(report.autoscaler_line(data))
    for name, t in data["tenants"].items():
        print(f"tenant {name}: {t['requests']} requests, {t['ok']} ok, {t['failed']} failed")
    print(f"report: {json_path} and {md_path}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
