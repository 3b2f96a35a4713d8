"""The mesh's own counters on the router's ``/metrics``, read at scrape time.

The mesh counts what it refuses or drops (malformed peer frames and values, frames over the size cap,
full send queues, dispatch entries and placements past their per-write bounds) in plain counters that
``GET /admin/mesh`` shows. A scrape must show them too: a peer sending garbage, or a mesh dropping
state under load, is an overload or an attack an operator alerts on, not something found by asking each
replica's admin API. A collector reads the live counters when scraped, so the hot paths keep their
plain ``Counter[str]`` increments.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.mesh_state import MeshState
from mesh.node import MeshNode


class MeshCollector(Collector):
    """Exports one replica's mesh counters; register it on the router's registry."""

    def __init__(self, node: MeshNode, state: MeshState) -> None:
        self._node = node
        self._state = state

    def collect(self) -> Iterator[Metric]:
        events = CounterMetricFamily(
            "kvmesh_mesh_events",
            "Mesh events by layer (transport: replication connections and frames; protocol: what frames did; "
            "node: membership and snapshots), drops and malformed frames included", labels=["layer", "event"])
        replication = self._node.replication
        layers = {"transport": replication.counters if replication is not None else {},
                  "protocol": self._node.protocol.counters, "node": self._node.stats}
        for layer, counters in layers.items():
            for event, count in sorted(counters.items()):
                events.add_metric([layer, event], count)
        yield events
        rejected = CounterMetricFamily(
            "kvmesh_mesh_values_rejected",
            "Replicated values refused as malformed, by namespace (document: values of no known type)",
            labels=["namespace"])
        rejected.add_metric(["document"], self._node.doc.malformed_values)
        for namespace, count in sorted(self._state.malformed.items()):
            rejected.add_metric([namespace], count)
        yield rejected
        dropped = CounterMetricFamily(
            "kvmesh_mesh_writes_dropped",
            "Entries this replica did not replicate because one write was full (dispatched blocks per "
            "bucket, placements per flush)", labels=["kind"])
        dropped.add_metric(["dispatch"], self._state.dispatch_dropped)
        dropped.add_metric(["placements"], self._state.placements_dropped)
        yield dropped
        failures = CounterMetricFamily(
            "kvmesh_mesh_task_failures",
            "Failures of the tasks writing this replica's state into the mesh (each is logged once per episode "
            "and started again after a backoff), by task and exception type", labels=["task", "reason"])
        for (task, reason), count in sorted(self._state.task_failures.items()):
            failures.add_metric([task, reason], count)
        yield failures
