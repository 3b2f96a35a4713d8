"""Chaos scenarios against a local cluster, the invariants they must keep, and their reports."""
