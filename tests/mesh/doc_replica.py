"""A replicated document laid out as per-engine pair maps, so replication tests read like the data they carry."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from mesh.crdt_doc import SEP, ReplicatedDoc


class Replica:
    def __init__(self, replica_id: str) -> None:
        self.doc = ReplicatedDoc(replica_id, ("pairs", "registry"))

    def store(self, engine: str, pairs: Sequence[tuple[int, int]]) -> int:
        return len(self.doc.write(("pairs", f"{engine}{SEP}{h}", str(v)) for h, v in pairs))

    def remove(self, engine: str, hashes: Iterable[int]) -> int:
        return len(self.doc.write(("pairs", f"{engine}{SEP}{h}", None) for h in hashes))

    def pairs(self, engine: str) -> dict[int, int]:
        result = {}
        for key, value in self.doc.content["pairs"].items():
            owner, _, h = key.partition(SEP)
            if owner == engine:
                result[int(h)] = int(value)
        return result

    def block_count(self, engine: str) -> int:
        return len(self.pairs(engine))

    def set_registry(self, engine: str, state: dict[str, Any] | None) -> None:
        self.doc.write([("registry", engine, None if state is None else json.dumps(state))])

    def registry(self) -> dict[str, Any]:
        return {k: json.loads(v) for k, v in self.doc.content["registry"].items()}

    def engines(self) -> list[str]:
        return sorted({key.partition(SEP)[0] for key in self.doc.content["pairs"]})
