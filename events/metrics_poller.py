"""Poll an engine's Prometheus /metrics: load, KV usage, cache geometry and prefix-cache hits.

Parsing is sans-IO (`parse_vllm_metrics`); `poll_metrics` is the owned trio loop around an injected
fetch(url) -> bytes, so the gateway can hand in its pooled HTTP client.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio
from prometheus_client.parser import text_string_to_metric_families

from events.counters import METRICS_POLLS

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


class MetricsParseError(ValueError):
    """The body is not Prometheus text or lacks the vLLM load gauges."""


_SUMMED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:prefix_cache_hits_total": "hits",
}


_READ = (*(name.removesuffix("_total") for name in _SUMMED), "vllm:kv_cache_usage_perc", "vllm:cache_config_info")
"""Family names: a counter's TYPE line names it without the ``_total`` its samples carry."""
_COMMENT_PREFIXES = ("# HELP ", "# TYPE ")
_COMMENT_LEN = len(_COMMENT_PREFIXES[0])


def relevant_lines(text: str) -> str:
    """Only the samples and comments of the families read here.

    A vLLM page is mostly histogram buckets, and prometheus_client's parser is slow: the simulated
    engine's 86-line page took 1.9 ms to parse whole and 0.49 ms filtered, once per engine per second.
    """
    return "\n".join(
        line for line in text.splitlines()
        if line.startswith(_READ) or (line.startswith(_COMMENT_PREFIXES) and line[_COMMENT_LEN:].startswith(_READ))
    ) + "\n"


def parse_vllm_metrics(text: str) -> EngineLoad:
    """Sum per-label series (several model names or DP engines) and read cache_config_info labels."""
    sums = dict.fromkeys(_SUMMED.values(), 0.0)
    seen: set[str] = set()
    usage = 0.0
    block_size = num_blocks = None
    try:
        for family in text_string_to_metric_families(relevant_lines(text)):
            for sample in family.samples:
                value = sample.value
                if not math.isfinite(value):
                    continue
                if sample.name in _SUMMED:
                    sums[_SUMMED[sample.name]] += value
                    seen.add(sample.name)
                elif sample.name == "vllm:kv_cache_usage_perc":
                    usage = max(usage, value)
                elif sample.name == "vllm:cache_config_info":
                    block_size = _int_label(sample.labels.get("block_size")) or block_size
                    num_blocks = _int_label(sample.labels.get("num_gpu_blocks")) or num_blocks
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise MetricsParseError("unparseable metrics text") from exc
    if "vllm:num_requests_running" not in seen:
        raise MetricsParseError("vllm:num_requests_running missing")
    return EngineLoad(int(sums["running"]), int(sums["waiting"]), min(1.0, max(0.0, usage)), block_size,
                      num_blocks, sums["queries"], sums["hits"])


def _int_label(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        number = int(float(value))
    except ValueError:
        return None
    return number if number > 0 else None


async def poll_metrics(engine: str, url: str, fetch: Fetch, on_load: Callable[[EngineLoad, float], None],
                       *, interval_s: float = 1.0, timeout_s: float = 2.0) -> None:
    """Poll until cancelled; failures are counted and retried at the next tick, never raised."""
    while True:
        started = trio.current_time()
        outcome = "ok"
        with trio.move_on_after(timeout_s) as scope:
            try:
                load = parse_vllm_metrics((await fetch(url)).decode("utf-8", "replace"))
            except MetricsParseError:
                outcome = "malformed"
            except Exception:  # the injected fetch may fail in any way; the next tick retries
                outcome = "error"
        if scope.cancelled_caught:
            outcome = "timeout"
        METRICS_POLLS.labels(engine=engine, outcome=outcome).inc()
        if outcome == "ok":
            on_load(load, trio.current_time())
        await trio.sleep_until(started + interval_s)
