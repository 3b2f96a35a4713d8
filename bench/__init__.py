"""Workloads, the benchmark runner and every ``kvmesh bench`` command, runs through a local cluster, the demo."""
