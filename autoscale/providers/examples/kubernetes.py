#!/usr/bin/env python3
"""Example `command` provider: one engine per Kubernetes pod, created from a manifest template.

UNTESTED against a real cluster: it is validated only against a fake `kubectl` (see the tests).

    [autoscaler]
    provider = "command"
    command = ["python3", "autoscale/providers/examples/kubernetes.py"]

Environment: KVMESH_K8S_TEMPLATE (a pod manifest in JSON; "{{name}}" is replaced by the pod's name),
KVMESH_K8S_NAMESPACE (default "default"), KVMESH_K8S_PORT (the engine's port, default 8000),
KVMESH_K8S_READY_TIMEOUT (default 600s).

Pods rather than `kubectl scale` on a Deployment: the autoscaler chooses which engine to release (the one
whose cache costs least), and a Deployment's scale-down would pick for itself. Pods carry the label
app.kubernetes.io/managed-by=kvmesh-autoscaler, which `list` selects on, and kvmesh.term, the lease term of
the replica that created them: provision and terminate are refused when a managed pod carries a newer
term than the request's (a replica that lost the lease, once the new holder has provisioned). Pod names
come from the request id, which is unique across the mesh and its restarts.
"""

import json
import os
import subprocess
import sys

NAMESPACE = os.environ.get("KVMESH_K8S_NAMESPACE", "default")
PORT = os.environ.get("KVMESH_K8S_PORT", "8000")
LABEL = "app.kubernetes.io/managed-by=kvmesh-autoscaler"
KUBECTL = ["kubectl", "-n", NAMESPACE]


def run(*argv: str, stdin: str | None = None) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, input=stdin).stdout


def engine(pod: dict) -> dict:
    labels = pod["metadata"].get("labels", {})
    return {"id": pod["metadata"]["name"], "url": f"http://{pod['status']['podIP']}:{PORT}",
            "offer": labels.get("kvmesh.offer", "")}


def managed_pods() -> list[dict]:
    return json.loads(run(*KUBECTL, "get", "pods", "-l", LABEL, "-o", "json"))["items"]


def fence(request: dict) -> None:
    """Exit non-zero when a managed pod was created under a newer lease term than the request's."""
    term = request.get("term")
    if not isinstance(term, int):
        raise SystemExit("request without a lease term")
    terms = [int(p["metadata"].get("labels", {}).get("kvmesh.term", "0")) for p in managed_pods()]
    if terms and max(terms) > term:
        raise SystemExit(f"stale lease term {term}: a pod of term {max(terms)} exists")


def main(action: str) -> dict:
    request = json.load(sys.stdin)
    if action in ("provision", "terminate"):
        fence(request)
    if action == "provision":
        name = f"kvmesh-engine-{request['request_id']}".lower().replace("_", "-")
        with open(os.environ["KVMESH_K8S_TEMPLATE"]) as f:
            manifest = json.loads(f.read().replace("{{name}}", name))
        labels = manifest.setdefault("metadata", {}).setdefault("labels", {})
        labels["app.kubernetes.io/managed-by"] = "kvmesh-autoscaler"
        labels["kvmesh.offer"] = request["offer"]["name"]
        labels["kvmesh.term"] = str(request["term"])
        run(*KUBECTL, "apply", "-f", "-", stdin=json.dumps(manifest))
        timeout = os.environ.get("KVMESH_K8S_READY_TIMEOUT", "600")
        run(*KUBECTL, "wait", "--for=condition=Ready", f"pod/{name}", f"--timeout={timeout}s")
        return engine(json.loads(run(*KUBECTL, "get", "pod", name, "-o", "json")))
    if action == "terminate":
        run(*KUBECTL, "delete", "pod", request["id"], "--wait=false")
        return {}
    if action == "list":
        return {"engines": [engine(p) for p in managed_pods() if p.get("status", {}).get("podIP")]}
    raise SystemExit(f"unknown action {action!r}")


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
