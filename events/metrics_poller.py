"""Poll an engine's Prometheus /metrics: load, KV usage, cache geometry and prefix-cache hits.

Parsing is sans-IO (`parse_vllm_metrics`); `poll_metrics` is the owned trio loop around an injected
fetch(url) -> bytes, so the gateway can hand in its pooled HTTP client.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from events.counters import ENGINE_VALUES_REJECTED, METRICS_POLLS
from events.poll_phase import phase_s, sleep_until_phase
from events.prometheus_samples import SampleError, wanted_samples

log = logging.getLogger("kvmesh.engines")
Fetch = Callable[[str], Awaitable[bytes]]


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int
    waiting: int
    kv_cache_usage: float
    block_size: int | None
    num_gpu_blocks: int | None
    prefix_cache_queries: float
    prefix_cache_hits: float
    rejected: tuple[str, ...] = ()
    """Values the engine reported out of range: left out (None, 0 or clamped) and counted by the poller."""
    max_lora: int | None = None
    """LoRA slots (``--max-loras``) of an engine serving adapters; None: it reports none."""
    running_adapters: frozenset[str] = frozenset()
    """Adapters of the requests running at the engine's last stats update (they hold its LoRA slots)."""


class MetricsParseError(ValueError):
    """The body is not Prometheus text or lacks the vLLM load gauges."""


class MetricsOutOfRange(MetricsParseError):
    """The engine's load gauges (running, waiting) are impossible: the poll tells nothing about its load."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__(f"out of range: {', '.join(names)}")
        self.names = names


MAX_REQUESTS = 10**6
"""Running or waiting requests beyond this are not a real engine's: the whole poll is refused."""
MAX_GPU_BLOCKS = 2**31
MAX_BLOCK_SIZE = 4096
MAX_COUNTER = float(2**53)
"""Prefix-cache counters stay exact below this; above it the engine's counters are not believed."""


_SUMMED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:prefix_cache_hits_total": "hits",
}


LORA_INFO = "vllm:lora_requests_info"
"""A gauge set to the time of each stats update, one series per label set ever seen: the newest is current."""
_KV_USAGE = "vllm:kv_cache_usage_perc"
_CACHE_CONFIG = "vllm:cache_config_info"
_WANTED = frozenset({*_SUMMED, _KV_USAGE, _CACHE_CONFIG, LORA_INFO})


def parse_vllm_metrics(text: str) -> EngineLoad:
    """Sum per-label series (several model names or DP engines) and read cache_config_info labels.

    Every number is bounded: impossible load gauges raise MetricsOutOfRange; an impossible block count,
    block size or counter is left out and named in ``EngineLoad.rejected``; KV usage is clamped to 0..1.
    """
    sums = dict.fromkeys(_SUMMED.values(), 0.0)
    seen: set[str] = set()
    rejected: list[str] = []
    usage = 0.0
    block_size = num_blocks = None
    lora: tuple[float, dict[str, str]] | None = None
    try:
        for sample in wanted_samples(text, _WANTED):
            value = sample.value
            if not math.isfinite(value):
                continue
            if sample.name in _SUMMED:
                sums[_SUMMED[sample.name]] += value
                seen.add(sample.name)
            elif sample.name == _KV_USAGE:
                usage = max(usage, value)
            elif sample.name == LORA_INFO:
                if lora is None or value > lora[0]:
                    lora = (value, sample.labels)
            else:
                block_size = _int_label(sample.labels.get("block_size"), MAX_BLOCK_SIZE, "block_size",
                                        rejected) or block_size
                num_blocks = _int_label(sample.labels.get("num_gpu_blocks"), MAX_GPU_BLOCKS, "num_gpu_blocks",
                                        rejected) or num_blocks
    except SampleError as exc:
        raise MetricsParseError("unparseable metrics text") from exc
    if "vllm:num_requests_running" not in seen:
        raise MetricsParseError("vllm:num_requests_running missing")
    impossible = tuple(name for name in ("running", "waiting") if not 0 <= sums[name] <= MAX_REQUESTS)
    if impossible:
        raise MetricsOutOfRange(impossible)
    for name in ("queries", "hits"):
        if not 0 <= sums[name] <= MAX_COUNTER:
            rejected.append(f"prefix_cache_{name}")
            sums[name] = 0.0
    max_lora, running_adapters = _lora_slots(lora, rejected)
    return EngineLoad(int(sums["running"]), int(sums["waiting"]), min(1.0, max(0.0, usage)), block_size,
                      num_blocks, sums["queries"], sums["hits"], tuple(rejected), max_lora, running_adapters)


MAX_LORAS = 4096


def _lora_slots(newest: tuple[float, dict[str, str]] | None, rejected: list[str]) -> tuple[int | None, frozenset[str]]:
    """(LoRA slots, adapters running) from the newest ``vllm:lora_requests_info`` series, if any."""
    if newest is None:
        return None, frozenset()
    labels = newest[1]
    slots = _int_label(labels.get("max_lora"), MAX_LORAS, "max_lora", rejected)
    running = labels.get("running_lora_adapters", "")
    names = frozenset(name for name in running.split(",") if name)
    return slots, names if len(names) <= MAX_LORAS else frozenset()


def _int_label(value: str | None, maximum: int, name: str, rejected: list[str]) -> int | None:
    """A positive integer label up to ``maximum``; None (and ``name`` noted in ``rejected``) otherwise.

    vLLM writes these as decimal integers; "None" means not known yet and is not a rejection.
    """
    if value is None or value == "None":
        return None
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number.is_integer() and 0 < number <= maximum):
        rejected.append(name)
        return None
    return int(number)


_reported: set[tuple[str, str]] = set()


def _count_rejected(engine: str, names: tuple[str, ...]) -> None:
    """Count every rejection; log the first of each (engine, value), since a lying engine lies every poll."""
    for name in names:
        ENGINE_VALUES_REJECTED.labels(engine=engine, value=name).inc()
        if (engine, name) not in _reported:
            _reported.add((engine, name))
            log.warning("engine reported an impossible %s; ignored", name, extra={"engine": engine})


async def poll_metrics(engine: str, url: str, fetch: Fetch, on_load: Callable[[EngineLoad, float], None],
                       *, interval_s: float = 1.0, timeout_s: float = 2.0,
                       due: Callable[[], bool] | None = None) -> None:
    """Poll until cancelled, at the engine's phase of each interval (``events.poll_phase``); failures are counted
    and retried at the next tick, never raised. ``due`` (``events.quiet_polls``) may skip a tick: counted as a
    ``quiet`` outcome."""
    phase = phase_s(engine, interval_s)
    while True:
        if due is not None and not due():
            METRICS_POLLS.labels(engine=engine, outcome="quiet").inc()
            await sleep_until_phase(interval_s, phase)
            continue
        outcome = "ok"
        with trio.move_on_after(timeout_s) as scope:
            try:
                load = parse_vllm_metrics((await fetch(url)).decode("utf-8", "replace"))
            except MetricsOutOfRange as exc:
                outcome = "out_of_range"
                _count_rejected(engine, exc.names)
            except MetricsParseError:
                outcome = "malformed"
            except Exception:  # the injected fetch may fail in any way; the next tick retries
                outcome = "error"
        if scope.cancelled_caught:
            outcome = "timeout"
        METRICS_POLLS.labels(engine=engine, outcome=outcome).inc()
        if outcome == "ok":
            _count_rejected(engine, load.rejected)
            on_load(load, trio.current_time())
        await sleep_until_phase(interval_s, phase)
