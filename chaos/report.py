"""The chaos report: JSON for machines (CI asserts on ``invariants``) and markdown for people."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.stats import percentile, summarize
from chaos.invariants import actors
from chaos.runner import ChaosRun


def _num(value: float | None, digits: int = 3) -> float | None:
    return None if value is None or math.isnan(value) else round(value, digits)


def autoscaler_summary(run: ChaosRun) -> dict[str, Any] | None:
    """Who acted when (each change of the actor set, with the terms it acted under) and what the pool
    provisioned; None on a cluster without an autoscaler."""
    if not any(s.autoscaler for s in run.samples):
        return None
    changes: list[dict[str, Any]] = []
    for s in run.samples:
        now = actors(s)
        if not changes or changes[-1]["actors"] != now:
            terms = sorted({v.term for name, v in s.autoscaler.items() if v is not None and name in now})
            changes.append({"t": round(s.t, 2), "actors": now, "terms": terms})
    pools = [s.pool for s in run.samples if s.pool is not None]
    last = pools[-1] if pools else None
    return {"samples": len(run.samples), "max_actors": max(len(actors(s)) for s in run.samples),
            "actor_changes": changes, "provisions": last.provisions if last else 0,
            "request_ids": list(last.requests) if last else []}


def tenants_summary(run: ChaosRun) -> dict[str, dict[str, int]]:
    """Requests, successes and failures per tenant (a cluster with auth)."""
    out: dict[str, dict[str, int]] = {}
    for r in run.records:
        if r.tenant:
            row = out.setdefault(r.tenant, {"requests": 0, "ok": 0, "failed": 0})
            row["requests"] += 1
            row["ok" if r.ok else "failed"] += 1
    return out


def build(run: ChaosRun) -> dict[str, Any]:
    ev = run.evaluation
    summary = summarize([r.as_result() for r in run.records], run.wall)
    failures = {c: n for c, n in ev.causes.items() if c != "ok"}
    return {
        "scenario": run.options.scenario,
        "passed": all(ev.invariants.values()),
        "invariants": ev.invariants,
        "options": asdict(run.options),
        "wall_s": round(run.wall, 2),
        "requests": {"total": len(run.records), "ok": ev.causes.get("ok", 0),
                     "failed": sum(failures.values()), "skipped_at_cap": run.skipped,
                     "ttft_p50_ms": _num(summary.ttft_p50 * 1000, 1), "ttft_p95_ms": _num(summary.ttft_p95 * 1000, 1),
                     "latency_p99_ms": _num(summary.latency_p99 * 1000, 1),
                     "per_engine": summary.routes},
        "continuations": {"streams": len(ev.continued),
                          "latency_p50_ms": _num(percentile(ev.continued, 50) * 1000, 1),
                          "latency_p99_ms": _num(percentile(ev.continued, 99) * 1000, 1)},
        "failures_by_cause": failures,
        "violations": ev.violations,
        "faults": [{**asdict(o), "hit_rate_pre": _num(o.hit_rate_pre), "convergence_s": _num(o.convergence_s),
                    "hit_rate_recovery_s": _num(o.hit_rate_recovery_s), "rejoin_s": _num(o.rejoin_s),
                    "inject_at": _num(o.inject_at), "healed_at": _num(o.healed_at), "observed_s": _num(o.observed_s)}
                   for o in ev.events],
        "actions": [asdict(a) for a in run.actions],
        "recovery": {
            "convergence_s": [_num(o.convergence_s) for o in ev.events],
            "hit_rate_recovery_s": [_num(o.hit_rate_recovery_s) for o in ev.events],
            "rejoin_s": [_num(o.rejoin_s) for o in ev.events if o.kind in ("kill-engine", "restart-engine")],
        },
        "undetermined": ev.undetermined,
        "crashes": ev.crashes,
        "processes": [asdict(g) for g in ev.growth],
        "samples": len(run.samples),
        "autoscaler": autoscaler_summary(run),
        "tenants": tenants_summary(run),
    }


def continuation_line(report: dict[str, Any]) -> str:
    c = report["continuations"]
    if not c["streams"]:
        return "No stream was under way on a killed engine."
    return (f"{c['streams']} streams were continued after their engine was killed; kill to next token "
            f"p50 {c['latency_p50_ms']} ms, p99 {c['latency_p99_ms']} ms.")


def autoscaler_line(report: dict[str, Any]) -> str:
    """The lease's record in one line (empty without an autoscaler)."""
    a = report.get("autoscaler")
    if not a:
        return ""
    path = " -> ".join(f"{'+'.join(c['actors']) or 'none'} at {c['t']} s" + (f" (term {c['terms'][0]})"
                                                                               if len(c["terms"]) == 1 else "")
                       for c in a["actor_changes"])
    return (f"autoscaler: at most {a['max_actors']} actor in {a['samples']} samples ({path}); "
            f"{a['provisions']} provisions, {len(set(a['request_ids']))} distinct request ids "
            f"({', '.join(a['request_ids']) or 'none'})")


def markdown(report: dict[str, Any]) -> str:
    verdict = "PASSED" if report["passed"] else "FAILED"
    req = report["requests"]
    lines = [f"# kvmesh chaos: {report['scenario']} ({verdict})", "",
             f"{req['total']} requests in {report['wall_s']} s: {req['ok']} ok, {req['failed']} failed, "
             f"{req['skipped_at_cap']} skipped at the in-flight cap; TTFT p50 {req['ttft_p50_ms']} ms, "
             f"p95 {req['ttft_p95_ms']} ms.", "", "| invariant | held |", "| --- | --- |"]
    lines += [f"| {name} | {'yes' if held else '**NO**'} |" for name, held in report["invariants"].items()]
    lines += ["", continuation_line(report)]
    if report.get("autoscaler"):
        lines += ["", autoscaler_line(report)]
    if report.get("tenants"):
        lines += ["", "| tenant | requests | ok | failed |", "| --- | --- | --- | --- |"]
        lines += [f"| {name} | {t['requests']} | {t['ok']} | {t['failed']} |" for name, t in report["tenants"].items()]
    lines += ["", "| cause | requests | allowed |", "| --- | --- | --- |"]
    lines += [f"| {c} | {n} | {'no' if c in report['violations'] else 'yes'} |"
              for c, n in sorted(report["failures_by_cause"].items())] or ["| (none) | 0 | |"]
    lines += ["", "| # | fault | target | inject s | healed s | applied | converged s | hit pre | hit back s | "
              "rejoin s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for f in report["faults"]:
        lines.append(f"| {f['index']} | {f['kind']} | {f['target']} | {f['inject_at']} | {f['healed_at']} | "
                     f"{'yes' if f['applied'] else '**no**'} | {f['convergence_s']} | {f['hit_rate_pre']} | "
                     f"{f['hit_rate_recovery_s']} | {f['rejoin_s'] if f['rejoin_s'] is not None else ''} |")
    lines += ["", "| process | pid | RSS start MB | RSS end MB | fds start | fds end |",
              "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {p['name']} | {p['pid']} | {p['rss_start_kb'] / 1024:.1f} | {p['rss_end_kb'] / 1024:.1f} | "
              f"{p['fds_start']} | {p['fds_end']} |" for p in report["processes"]]
    for title, items in (("Crashes", report["crashes"]), ("Undetermined (watch cut short by the next fault)",
                                                          report["undetermined"])):
        if items:
            lines += ["", f"## {title}", "", *[f"- {item}" for item in items]]
    failed_actions = [a for a in report["actions"] if not a["ok"]]
    if failed_actions:
        lines += ["", "## Fault actions that failed", "",
                  *[f"- {a['fault']} {a['action']} {a['target']}: {a['detail']}" for a in failed_actions]]
    return "\n".join(lines) + "\n"


def write(report: dict[str, Any], path: Path) -> tuple[Path, Path]:
    """Write ``path`` (JSON) and the markdown next to it (same name, ``.md``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    md = path.with_suffix(".md")
    md.write_text(markdown(report))
    return path, md
