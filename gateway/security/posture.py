"""What a router started with auth off leaves open, said once at start-up with how to close each surface.

Auth is off by default so a local cluster works out of the box; an operator who deploys that way should
learn from the first log lines, not from an incident, who can add engines or read the cache.
"""

from __future__ import annotations

import logging

from gateway.config import RouterConfig
from gateway.security.config import is_loopback_host

log = logging.getLogger("kvmesh.security")
ENABLE_AUTH = "set [auth] enabled = true with admin_keys (and [[tenants]] keys for clients)"


def open_surfaces(config: RouterConfig) -> list[dict[str, str]]:
    """Each surface that answers without a credential: what it allows and how to close it."""
    surfaces = []
    if not config.auth.enabled:
        surfaces += [
            {"surface": "/v1/chat/completions, /v1/completions, /v1/models",
             "allows": "inference on every engine, with no rate limits", "close": ENABLE_AUTH},
            {"surface": "/admin/engines", "allows": "adding, removing, draining engines fleet-wide (prompts "
             "can be sent to an engine the caller controls)", "close": ENABLE_AUTH},
            {"surface": "/debug/route", "allows": "the cached prefix overlap of any prompt on every engine",
             "close": ENABLE_AUTH},
        ]
        if config.mesh.bind:
            surfaces.append({"surface": "/admin/mesh/isolate", "allows": "partitioning this replica from its "
                             "mesh", "close": ENABLE_AUTH})
    surfaces.append({"surface": "/metrics", "allows": "engine ids, load and error counts (no credential is "
                     "ever asked)", "close": "bind to loopback or restrict the port at the network"})
    if config.mesh.bind and not config.mesh.secret_file:
        surfaces.append({"surface": f"mesh {config.mesh.bind}", "allows": "joining the mesh and writing the "
                         "replicated index", "close": "set mesh.secret_file"})
    return surfaces


def log_posture(config: RouterConfig) -> None:
    """A warning per open surface, unless auth is on and the router only listens on loopback."""
    if config.auth.enabled and is_loopback_host(config.host):
        return
    reach = "this host only" if is_loopback_host(config.host) else f"anyone who reaches {config.host}:{config.port}"
    if not config.auth.enabled and not is_loopback_host(config.host):
        log.warning("AUTH IS OFF ON AN OPEN ADDRESS: [auth] allow_open_network = true makes everyone who "
                    "reaches this router an admin (add or delete engines fleet-wide, partition the mesh, "
                    "read every tenant's cache state)", extra={"reachable_by": reach, "close": ENABLE_AUTH})
    for surface in open_surfaces(config):
        log.warning("open surface", extra={**surface, "reachable_by": reach})
