"""Free loopback ports chosen by the kernel, for processes whose addresses must be known in advance.

Routers need their gossip and replication addresses before they start (each one's seeds are the
others), so those ports cannot be bound to 0 by the router itself.
"""

from __future__ import annotations

import socket

HOST = "127.0.0.1"


def _udp_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(udp_too: bool = False, attempts: int = 100) -> int:
    """A TCP port (and the same UDP port when ``udp_too``) that was free a moment ago."""
    for _ in range(attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port = sock.getsockname()[1]
        if not udp_too or _udp_free(port):
            return port
    raise OSError(f"no free port found in {attempts} attempts")


def free_ports(count: int, udp_too: bool = False) -> list[int]:
    """``count`` distinct free ports (the kernel may hand out a port twice in a row)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port(udp_too)
        if port not in ports:
            ports.append(port)
    return ports
