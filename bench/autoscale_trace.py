"""The autoscaling benchmark's arithmetic, free of I/O: the traffic ramp, arrival times, the traffic mix,
per-window TTFT p99, engine-seconds, flapping, and the verdicts of its targets.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.report import Verdict
from bench.stats import RequestResult, percentile
from bench.workloads import Conversation, text


@dataclass(frozen=True)
class Trace:
    """Quiet, a burst, quiet again, then a slow diurnal rise and fall; rates in requests per second."""

    duration_s: float
    peak_rps: float
    quiet: float = 0.15
    """Quiet rate as a share of the peak."""
    burst: float = 0.8
    """Burst height as a share of the peak (the diurnal top reaches the peak)."""

    def phases(self) -> list[tuple[str, float, float]]:
        d = self.duration_s
        return [("quiet", 0.0, 0.13 * d), ("burst", 0.13 * d, 0.3 * d), ("quiet", 0.3 * d, 0.4 * d),
                ("diurnal", 0.4 * d, d)]

    def rate(self, t: float) -> float:
        low = self.quiet * self.peak_rps
        _, (_, burst_start, burst_end), _, (_, day_start, end) = self.phases()
        if burst_start <= t < burst_end:
            rise = (burst_end - burst_start) * 0.25
            edge = min(t - burst_start, burst_end - t, rise) / rise
            return low + edge * (self.burst * self.peak_rps - low)
        if day_start <= t < end:
            phase = (t - day_start) / (end - day_start)
            return low + (self.peak_rps - low) * math.sin(math.pi * phase) ** 2
        return low

    def arrivals(self, step_s: float = 0.005) -> list[float]:
        """Arrival times at the ramp's rate: request i when the integrated rate reaches i + 0.5."""
        times, total, t, nxt = [], 0.0, 0.0, 0.5
        while t < self.duration_s:
            total += self.rate(t) * step_s
            t += step_s
            while total >= nxt:
                times.append(t)
                nxt += 1
        return times

    def mean_rps(self) -> float:
        return len(self.arrivals()) / self.duration_s


@dataclass
class TrafficMix:
    """Shared-prefix requests (a few long system prompts) and multi-turn chats, seeded.

    A chat's next turn is only sent once its previous answer arrived; when every chat is busy or done a new
    one starts, so open-loop arrivals never wait for the service."""

    seed: int
    chat_share: float = 0.4
    system_prompts: int = 6
    system_tokens: int = 400
    chat_turns: int = 4
    max_tokens: int = 24
    rng: random.Random = field(init=False)
    systems: list[str] = field(init=False)
    chats: list[Conversation] = field(default_factory=list)
    busy: set[str] = field(default_factory=set)
    made: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.systems = [f"System {s}:" + text(self.rng, self.system_tokens) for s in range(self.system_prompts)]

    def next(self) -> Conversation:
        self.made += 1
        if self.rng.random() >= self.chat_share:
            system = self.systems[self.rng.randrange(len(self.systems))]
            return Conversation(f"s{self.made}", [text(self.rng, self.rng.randint(20, 60))], self.max_tokens,
                                system)
        for chat in self.chats:
            if chat.key not in self.busy and not chat.done:
                self.busy.add(chat.key)
                return chat
        chat = Conversation(f"chat{self.made}", [text(self.rng, self.rng.randint(20, 60))
                                                  for _ in range(self.chat_turns)],
                            self.max_tokens, f"Assistant {self.made}:" + text(self.rng, 150))
        self.chats = [c for c in self.chats if not c.done] + [chat]
        self.busy.add(chat.key)
        return chat

    def answered(self, conversation: Conversation, answer: str) -> None:
        if conversation.key in self.busy:
            conversation.record_answer(answer)
            self.busy.discard(conversation.key)


@dataclass
class RunRecord:
    """One fleet on the trace: requests, the engine count over time, and the autoscaler's decisions."""

    label: str
    results: list[RequestResult]
    samples: list[tuple[float, float]]
    """(seconds since the trace started, engines paid for: registered plus being provisioned)."""
    price_per_hour: float
    duration_s: float
    decisions: list[dict] = field(default_factory=list)
    started_unix: float = 0.0
    """Wall time of the trace's start (decisions carry wall times)."""

    def engine_seconds(self) -> float:
        """The engine count as a step function over the trace, integrated."""
        points = sorted(self.samples)
        if not points:
            return 0.0
        total = 0.0
        for (t0, n), (t1, _) in zip(points, [*points[1:], (self.duration_s, 0.0)], strict=True):
            total += n * max(0.0, min(t1, self.duration_s) - max(t0, 0.0))
        return total

    def cost(self) -> float:
        return self.engine_seconds() / 3600 * self.price_per_hour

    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.results if r.ok and r.ttft is not None]

    @property
    def failed(self) -> int:
        return sum(1 for r in self.results if not r.ok)

    def window_p99(self, window_s: float) -> list[float]:
        """TTFT p99 of the requests started in each window; inf when over 1% of them failed (0: none sent)."""
        windows = math.ceil(self.duration_s / window_s)
        buckets: list[list[RequestResult]] = [[] for _ in range(windows)]
        for r in self.results:
            buckets[min(windows - 1, int(r.started // window_s))].append(r)
        p99s = []
        for bucket in buckets:
            ttfts = [r.ttft for r in bucket if r.ok and r.ttft is not None]
            failed = len(bucket) - len(ttfts)
            p99s.append(math.inf if failed > 0.01 * len(bucket) else percentile(ttfts, 99) if ttfts else 0.0)
        return p99s

    def slo_windows(self, window_s: float, ceiling_s: float) -> tuple[int, int]:
        """(windows whose TTFT p99 exceeded the ceiling, windows)."""
        p99s = self.window_p99(window_s)
        return sum(1 for p in p99s if p > ceiling_s), len(p99s)

    def scale_events(self) -> list[dict]:
        return [d for d in self.decisions if d.get("action") in ("up", "down")]

    def released(self) -> set[str]:
        return {engine for d in self.decisions if d.get("action") == "down" for engine in d.get("release", [])}

    def scale_down_failures(self) -> int:
        """Failed requests a scale-down could have caused: those served by an engine that was released, and
        every stream that broke after it began (admission refusals under overload are not counted)."""
        released = self.released()
        return sum(1 for r in self.results if not r.ok and (
            served_by(r.route) in released or r.error in BROKEN_STREAM))

    def failure_kinds(self) -> dict[str, int]:
        return dict(Counter(r.error or f"http {r.status}" for r in self.results if not r.ok))


BROKEN_STREAM = ("error event", "stream ended early")


def served_by(route: str) -> str:
    """The engine that answered, from an ``x-kvmesh-route`` header (``served_by`` after a retry)."""
    fields = dict(part.strip().split("=", 1) for part in route.split(";") if "=" in part)
    return fields.get("served_by") or fields.get("engine", "")


def direction_changes(decisions: Sequence[dict]) -> list[float]:
    """Times at which a scale event went the other way from the previous one."""
    changes, last = [], None
    for d in sorted(decisions, key=lambda d: d["at"]):
        if d.get("action") not in ("up", "down"):
            continue
        if last is not None and d["action"] != last:
            changes.append(float(d["at"]))
        last = d["action"]
    return changes


def judge(auto: RunRecord, peak: RunRecord, average: RunRecord, window_s: float, ceiling_s: float,
          cooldown_s: float, lease: tuple[float | None, int] | None) -> list[Verdict]:
    """One verdict per target (``lease``: handover seconds and provisions, None when skipped)."""
    share = auto.engine_seconds() / peak.engine_seconds() if peak.engine_seconds() else math.nan
    bad, windows = auto.slo_windows(window_s, ceiling_s)
    avg_bad, _ = average.slo_windows(window_s, ceiling_s)
    within = 1 - bad / windows if windows else math.nan
    downs = sum(1 for d in auto.decisions if d.get("action") == "down")
    changes = direction_changes(auto.decisions)
    gaps = [b - a for a, b in zip(changes, changes[1:], strict=False)]
    verdicts = [
        Verdict("engine-seconds vs peak-sized fleet", share, "<= 0.70", share <= 0.70),
        Verdict("minutes with TTFT p99 within the ceiling", within, ">= 0.95", within >= 0.95,
                f"{bad}/{windows} windows over {ceiling_s:.2f} s; average-sized fleet: {avg_bad} over"),
        Verdict("failed requests across scale-downs", auto.scale_down_failures(), "0, with >= 1 scale-down",
                auto.scale_down_failures() == 0 and downs > 0,
                f"{downs} scale-downs, {len(auto.released())} engines released; all failures: "
                f"{auto.failure_kinds() or 'none'}"),
        Verdict("changes of direction per cooldown window", 2.0 if any(g < cooldown_s for g in gaps) else
                min(1.0, len(changes)), "<= 1", all(g >= cooldown_s for g in gaps),
                f"{len(changes)} changes, cooldown {cooldown_s:.0f} s"),
    ]
    if lease is not None:
        handover_s, provisions = lease
        took = math.nan if handover_s is None else handover_s
        verdicts.append(Verdict("lease handover after killing its holder (s)", took, "<= 5, one provision",
                                took <= 5 and provisions == 1,
                                f"{provisions} provision(s)" if handover_s is not None else "no replica took over"))
    return verdicts
