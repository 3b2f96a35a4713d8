"""The sans-IO block index: kvmesh's own chained hash, per-engine holdings, ingest, freshness, confidence."""
