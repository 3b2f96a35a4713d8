"""The cluster's state file: every process of a local cluster, so ``kvmesh down``, ``status`` and the
chaos scripts can find, stop or restart each one after ``kvmesh up`` has exited."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cluster.daemon import ProcessRecord
from cluster.router_config import ClusterKeys

STATE_FILE = "cluster.json"
DEFAULT_STATE_DIR = ".kvmesh"


@dataclass
class ClusterState:
    """What ``kvmesh up`` started; ``processes`` are in start order (stop them in reverse)."""

    state_dir: str
    haproxy_url: str
    stats_url: str
    policy: str
    meshed: bool
    secret_file: str
    redis_url: str | None = None
    processes: list[ProcessRecord] = field(default_factory=list)
    pool_file: str = ""
    """The standby pool's state (provisions and their request ids) when the routers run an autoscaler."""
    keys_file: str = ""
    """The API keys (``cluster.router_config.ClusterKeys``) when the routers run with auth."""

    def keys(self) -> ClusterKeys | None:
        return ClusterKeys.load(Path(self.keys_file)) if self.keys_file else None

    def by_role(self, role: str) -> list[ProcessRecord]:
        return [p for p in self.processes if p.role == role]

    def find(self, name: str) -> ProcessRecord:
        for record in self.processes:
            if record.name == name:
                return record
        raise KeyError(f"no process named {name!r} in {self.path}")

    @property
    def path(self) -> Path:
        return Path(self.state_dir) / STATE_FILE

    def save(self) -> Path:
        """Write atomically, so a reader never sees half a file."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(self.path)
        return self.path


def load(state_dir: Path) -> ClusterState:
    """Raises FileNotFoundError when no cluster state exists there, ValueError when it is malformed."""
    raw = json.loads((state_dir / STATE_FILE).read_text())
    try:
        processes = [ProcessRecord(**p) for p in raw.pop("processes")]
        return ClusterState(**raw, processes=processes)
    except (TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"malformed cluster state {state_dir / STATE_FILE}: {exc}") from exc
