#!/usr/bin/env python3
"""Example `command` provider: hand out engines from a pool of standby URLs (already running).

    command = ["python3", "autoscale/providers/examples/standby_pool.py", "/var/lib/kvmesh/pool.json",
               "http://10.0.0.7:8000", "http://10.0.0.8:8000"]

The state file records which standby engines are in use, how many provisions were made and the request id
of each (several router replicas may share it: each call holds an exclusive lock on it; a reader takes a
shared one). Two provisions with one request id mean two replicas acted for one lease term, since ids are
``<provider>-<term>-<n>``. provision takes the first free URL, terminate gives it back, list names those
in use. A request whose lease term is older than the newest one seen is refused, so a replica that lost the
lease cannot take or give back engines. Used by the tests, `kvmesh up --standby` and `kvmesh bench
autoscale`.
"""

import fcntl
import json
import sys
from pathlib import Path


def main(state_path: str, urls: list[str], action: str) -> dict:
    request = json.load(sys.stdin)
    path = Path(state_path)
    path.touch()
    with path.open("r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        text = f.read()
        state = json.loads(text) if text else {"provisions": 0, "in_use": {}}
        term = request.get("term")
        if not isinstance(term, int) or term < state.get("term", -1):
            raise SystemExit(f"stale lease term {term}: term {state.get('term')} has been seen")
        state["term"] = term
        if action == "provision":
            free = [u for u in urls if u not in state["in_use"].values()]
            if not free:
                raise SystemExit("no standby engine left")
            state["provisions"] += 1
            state.setdefault("requests", []).append(request.get("request_id"))
            engine_id = f"standby-{urls.index(free[0])}"
            state["in_use"][engine_id] = free[0]
            answer = {"id": engine_id, "url": free[0], "offer": request["offer"]["name"]}
        elif action == "terminate":
            state["in_use"].pop(request["id"], None)
            answer = {}
        elif action == "list":
            answer = {"engines": [{"id": k, "url": v} for k, v in sorted(state["in_use"].items())]}
        else:
            raise SystemExit(f"unknown action {action!r}")
        f.seek(0)
        f.truncate()
        f.write(json.dumps(state))
    return answer


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2:-1], sys.argv[-1])))
