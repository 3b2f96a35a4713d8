#!/usr/bin/env python3
"""Example `command` provider: one engine per container of a docker compose service.

UNTESTED against a real Docker daemon: it is validated only against a fake `docker` (see the tests).

    [autoscaler]
    provider = "command"
    command = ["python3", "autoscale/providers/examples/docker_compose.py"]

Environment: KVMESH_COMPOSE_FILE (default docker-compose.yml), KVMESH_COMPOSE_SERVICE (default engine),
KVMESH_COMPOSE_PORT (the engine's port inside the container, default 8000), KVMESH_ENGINE_HOST (where the
published ports are reachable, default 127.0.0.1), KVMESH_FENCE_FILE (where the newest lease term seen is
kept, default .kvmesh-autoscaler-term; every replica's calls must reach the same file, as they reach the same
Docker host). The service must publish its port to a random host port. Pass them on with ``command_env``.

Every request's lease term is checked first (fence.py): a router replica that lost the lease is refused.

provision scales the service up by one with `docker compose up --scale` and reports the new container;
terminate stops and removes exactly the named container (compose's own scale-down would pick for itself).
"""

import json
import os
import subprocess
import sys

from fence import admit

COMPOSE = ["docker", "compose", "-f", os.environ.get("KVMESH_COMPOSE_FILE", "docker-compose.yml")]
SERVICE = os.environ.get("KVMESH_COMPOSE_SERVICE", "engine")
PORT = os.environ.get("KVMESH_COMPOSE_PORT", "8000")
HOST = os.environ.get("KVMESH_ENGINE_HOST", "127.0.0.1")
FENCE = os.environ.get("KVMESH_FENCE_FILE", ".kvmesh-autoscaler-term")


def run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def containers() -> list[str]:
    return [line.strip()[:12] for line in run(*COMPOSE, "ps", "-q", SERVICE).splitlines() if line.strip()]


def engine(container: str) -> dict:
    published = run("docker", "port", container, f"{PORT}/tcp").splitlines()[0].strip()
    return {"id": container, "url": f"http://{HOST}:{published.rsplit(':', 1)[1]}"}


def main(action: str) -> dict:
    request = json.load(sys.stdin)
    admit(FENCE, request)
    if action == "provision":
        before = containers()
        run(*COMPOSE, "up", "-d", "--no-recreate", "--scale", f"{SERVICE}={len(before) + 1}", SERVICE)
        new = [c for c in containers() if c not in before]
        if not new:
            raise SystemExit("docker compose started no new container")
        return {**engine(new[0]), "offer": request["offer"]["name"]}
    if action == "terminate":
        run("docker", "rm", "-f", request["id"])
        return {}
    if action == "list":
        return {"engines": [engine(c) for c in containers()]}
    raise SystemExit(f"unknown action {action!r}")


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
