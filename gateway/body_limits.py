"""The ``[limits]`` config table: how large and how deep a request body may be before the router reads it.

Every limit is checked before tokenizing, so one hostile body costs the event loop a bounded amount of
work. The body's byte size is bounded separately by ``max_body_bytes`` (read before parsing).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config_errors import ConfigError


@dataclass
class LimitsConfig:
    max_depth: int = 64
    """Nesting of JSON objects and arrays; OpenAI bodies (tool schemas included) stay far below it."""
    max_messages: int = 4096
    """Chat messages per request; rendering 20k tiny messages costs the event loop about half a second."""
    max_content_parts: int = 256
    """Content parts per chat message."""
    max_string_chars: int = 4 * 1024 * 1024
    """Characters in any one JSON string (a prompt, a message, a key)."""
    body_timeout_s: float = 60.0
    """Time to receive a whole body (8 MiB at 1 Mbit/s takes about 64 s)."""
    max_model_len: int = 0
    """Context length assumed for engines that do not report one in ``/v1/models`` (0: no assumption)."""

    def validate(self, where: str) -> None:
        for key in ("max_depth", "max_messages", "max_content_parts", "max_string_chars"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{where}.{key}: must be at least 1")
        if not self.body_timeout_s > 0:
            raise ConfigError(f"{where}.body_timeout_s: must be positive")
        if self.max_model_len < 0:
            raise ConfigError(f"{where}.max_model_len: must not be negative")
