"""vLLM's Prometheus metrics for one simulated engine, rendered with prometheus_client.

Names and labels are vLLM's (docs/vllm.md) so that pollers and dashboards work unchanged. Gauges and
counters are read from the engine state at scrape time; latency histograms are observed here.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(slots=True)
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for bound, c in zip((*self.bounds, float("inf")), self.counts, strict=True):
            acc += c
            out.append(("+Inf" if bound == float("inf") else repr(bound), acc))
        return out


@dataclass(slots=True)
class Snapshot:
    """Engine state read at scrape time."""

    running: int
    waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    success: dict[str, int]
    external_queries: int = 0
    external_hits: int = 0
    lora: dict[str, str] | None = None


class EngineMetrics:
    """Histograms and the collector producing the /metrics text of one engine."""

    def __init__(self, model_name: str, cache_info: dict[str, str], snapshot: Callable[[], Snapshot]) -> None:
        self.labels = {"model_name": model_name, "engine": "0"}
        self.cache_info = {**cache_info, "engine": "0"}
        self.snapshot = snapshot
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _hist(self, name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
        m = HistogramMetricFamily(name, doc, labels=list(self.labels))
        m.add_metric(list(self.labels.values()), h.cumulative(), h.total)
        return m

    def collect(self) -> Iterator[object]:
        s = self.snapshot()
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          s.running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage)
        yield self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
                            "tokens.", s.prefix_queries)
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                            s.prefix_hits)
        yield self._counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens.", s.prefix_hits)
        yield self._counter("vllm:external_prefix_cache_queries", "External prefix cache queries from KV "
                            "connector cross-instance cache sharing, in terms of number of queried tokens.",
                            s.external_queries)
        yield self._counter("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector "
                            "cross-instance cache sharing, in terms of number of cached tokens.", s.external_hits)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                            s.preemptions)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            s.generation_tokens)
        ok = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                 labels=[*self.labels, "finished_reason"])
        for reason, n in sorted(s.success.items()):
            ok.add_metric([*self.labels.values(), reason], n)
        yield ok
        yield self._hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         self.ttft)
        yield self._hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                         self.e2e)
        if s.lora is not None:  # vLLM sets it to the time of each update, one series per label set
            lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.", labels=list(s.lora))
            lora.add_metric(list(s.lora.values()), time.time())
            yield lora
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=list(self.cache_info))
        info.add_metric(list(self.cache_info.values()), 1.0)
        yield info

    def render(self) -> bytes:
        return generate_latest(self.registry)
