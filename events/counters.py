"""Prometheus counters of the event path (default registry, exported by the gateway's /metrics)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from index.ingest_times import INGEST_PROCESS_TIMES, INGEST_TIMES

EVENTS_DROPPED = Counter(
    "kvmesh_events_dropped_total", "KV-event messages dropped before reaching the index", ["engine", "reason"]
)
EVENT_BATCHES = Counter("kvmesh_event_batches_total", "KV-event batches applied to the index", ["engine"])
BLOCK_OPS = Counter("kvmesh_event_block_ops_total", "Block operations applied from KV events", ["engine", "op"])
REPLAYS = Counter("kvmesh_event_replays_total", "Replay requests by outcome", ["engine", "outcome"])
METRICS_POLLS = Counter("kvmesh_metrics_polls_total",
                        "Engine /metrics poll ticks by outcome (quiet: not polled, the engine idle)",
                        ["engine", "outcome"])
HEALTH_POLLS = Counter("kvmesh_health_polls_total",
                       "Engine /health poll ticks by outcome (ok, failed; answered: not polled, its KV events and a "
                       "/metrics answer since the last tick said as much; quiet: not polled, nobody uses the engine)",
                       ["engine", "outcome"])
SUBSCRIBER_RESTARTS = Counter("kvmesh_event_subscriber_restarts_total",
                              "Event subscriber sessions rebuilt after a disconnect or socket error",
                              ["engine", "reason"])
INGEST_DEFERRED = Counter("kvmesh_event_ingest_deferred_seconds_total",
                          "Seconds event ingest waited because it had used its share of the event loop",
                          ["engine"])
ENGINE_TASK_FAILURES = Counter("kvmesh_engine_task_failures_total",
                               "Failures of an engine's background tasks (discovery, health, metrics), retried "
                               "after a backoff", ["engine", "task", "reason"])
ENGINE_VALUES_REJECTED = Counter("kvmesh_engine_values_rejected_total",
                                 "Numbers an engine reported that were out of range and ignored", ["engine", "value"])
INGEST_PROCESS_FAILURES = Counter("kvmesh_ingest_process_failures_total",
                                  "Times the replica's ingest process ended or sent what does not decode, and was "
                                  "started again")
INDEX_REGROWN = Counter("kvmesh_index_regrown_total",
                        "Doublings of the index's mask table built ahead of ingest in a worker thread: adopted, "
                        "stale (the index changed meanwhile; a store doubles it in place) or failed", ["outcome"])


class _IngestSeconds(Collector):
    """The ingest times (index/ingest_times.py) by process and step, read when scraped: a Counter's ``inc`` per
    message and stored event would cost more than the reads it sums."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("kvmesh_ingest_seconds", "Seconds KV-event ingest took, by process (serving: "
                                     "this one; ingest: its ingest process) and step: decode, keys, store, and the "
                                     "rest of its drain slices", labels=["process", "step"])
        for process, times in (("serving", INGEST_TIMES), ("ingest", INGEST_PROCESS_TIMES)):
            for step, seconds in times.steps().items():
                family.add_metric([process, step], seconds)
        yield family


REGISTRY.register(_IngestSeconds())
