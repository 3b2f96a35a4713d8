"""The ``[admission]`` config table: queue threshold for shedding and the rate-limit windows."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config_errors import ConfigError


@dataclass
class AdmissionConfig:
    queue_threshold: int = 256
    """Per engine, this router's in-flight requests plus the engine's waiting ones from which normal requests are
    shed (low ones from half). vLLM's default ``max_num_seqs`` is 256 (1024 for its server on large GPUs): at 64
    the router refused the 65th stream to an engine that runs 256 at once, which a plain relay never does."""
    queue_retry_after_s: float = 1.0
    request_window_s: float = 10.0
    request_slots: int = 10
    request_burst_s: float = 1.0
    token_window_s: float = 60.0
    token_slots: int = 12
    token_burst_s: float = 60.0
    peer_stale_after_s: float = 3.0
    peer_forget_after_s: float = 30.0
    debug_route_per_second: float = 2.0
    debug_route_burst: int = 10
    """Per client (tenant and address): /debug/route tokenizes and scores every engine for each call."""

    def validate(self, where: str) -> None:
        if self.queue_threshold < 1:
            raise ConfigError(f"{where}.queue_threshold: must be at least 1")
        for key in ("request_slots", "token_slots"):
            if not 1 <= getattr(self, key) <= 600:
                raise ConfigError(f"{where}.{key}: must be between 1 and 600")
        for key in ("queue_retry_after_s", "request_window_s", "request_burst_s", "token_window_s",
                    "token_burst_s", "peer_stale_after_s", "peer_forget_after_s", "debug_route_per_second"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{where}.{key}: must be positive")
        if self.debug_route_burst < 1:
            raise ConfigError(f"{where}.debug_route_burst: must be at least 1")
        if self.peer_forget_after_s < self.peer_stale_after_s:
            raise ConfigError(f"{where}.peer_forget_after_s: must not be shorter than peer_stale_after_s")
