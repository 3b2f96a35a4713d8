"""The fencing check the example providers share: refuse a request whose lease term is older than the
newest one seen (the router sends its term with every request; see autoscale/providers/command.py).

A replica that lost the autoscaler lease without knowing it yet (a partition, a stalled loop) still
sends its old term; once the new holder has called with a higher one, the old holder is refused.
"""

import fcntl
import json
from pathlib import Path


def admit(path: str, request: dict) -> None:
    """Record ``request["term"]`` in the file at ``path`` or exit non-zero when it is stale."""
    term = request.get("term")
    if not isinstance(term, int):
        raise SystemExit("request without a lease term")
    file = Path(path)
    file.touch()
    with file.open("r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        text = f.read()
        newest = json.loads(text)["term"] if text else -1
        if term < newest:
            raise SystemExit(f"stale lease term {term}: term {newest} has been seen")
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"term": term}))
