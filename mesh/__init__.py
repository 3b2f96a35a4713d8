"""Generic replication between router replicas: SWIM membership, a pycrdt document, state transfer, Redis seeds."""
