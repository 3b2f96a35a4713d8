"""Local process orchestration: simulated and real engines, router replicas, HAProxy, Redis."""
