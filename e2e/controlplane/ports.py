"""Loopback port helpers for the local control plane: pick free ports, and see which are listening.

Why: every component listens on 127.0.0.1 on a port picked at start (several sessions may run their
own control planes at once), and stop() must prove no port is left listening. Called by cluster.py.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from pathlib import Path

_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports free right now (all bound at once so the kernel cannot repeat one)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def listening(ports: Iterable[int]) -> list[int]:
    """The subset of `ports` that some socket on this machine listens on (IPv4 or IPv6).

    Reads /proc/net/tcp{,6} rather than trying to bind, because a port in TIME_WAIT after a clean
    shutdown is not a leftover.
    """
    wanted = set(ports)
    found: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            # fields[1] is local "ADDR:PORT" in hex, fields[3] the state
            port = int(fields[1].rsplit(":", 1)[1], 16)
            if fields[3] == _LISTEN and port in wanted:
                found.add(port)
    return sorted(found)
