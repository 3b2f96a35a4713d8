"""A request's priority class, passed on to the engine as vLLM's ``priority`` field (off by default).

The router's classes (``high``/``normal``/``low``: the tenant's, or its ``x-priority`` header when allowed)
drive admission and shedding in front of the engines; with this on, they also order the engine's own queue.
vLLM schedules a lower ``priority`` value first, and only with ``--scheduling-policy priority``: its API
documents that any value other than 0 is refused by an engine on the default first-come policy, which is
why the map is off unless the operator says the engines run with that flag. When on, the router's value
replaces a client's own ``priority``: a tenant cannot jump the engine's queue by writing it in its body.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from gateway.config_errors import ConfigError
from gateway.request_body import ParsedRequest
from gateway.security.config import PRIORITIES

_INT64 = 2**63
DEFAULT_VALUES = {"high": -10, "normal": 0, "low": 10}


@dataclass
class EnginePriorityConfig:
    """The ``[engine_priority]`` table."""

    enabled: bool = False
    values: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_VALUES))
    """vLLM ``priority`` per class (lower is served first); a class not named sends 0."""

    def validate(self, where: str) -> None:
        for name, value in self.values.items():
            if name not in PRIORITIES:
                raise ConfigError(f"{where}.values.{name}: not a priority class ({' | '.join(PRIORITIES)})")
            if not -_INT64 <= value < _INT64:
                raise ConfigError(f"{where}.values.{name}: must fit a signed 64-bit integer")


def with_engine_priority(config: EnginePriorityConfig, priority: str, parsed: ParsedRequest) -> ParsedRequest:
    """The request to forward: its body carries the class's engine priority when the map is on; the client's
    exact bytes otherwise, or when it already says the same."""
    if not config.enabled:
        return parsed
    value = config.values.get(priority, 0)
    if parsed.body.get("priority") == value and type(parsed.body.get("priority")) is int:
        return parsed
    body = {**parsed.body, "priority": value}
    return dataclasses.replace(parsed, body=body, raw=json.dumps(body, separators=(",", ":")).encode())
