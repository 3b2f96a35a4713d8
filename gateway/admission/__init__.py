"""Admission: per-tenant rate limits (cluster-wide) and priority-based load shedding, all sans-IO."""
