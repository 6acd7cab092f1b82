"""Which TCP sockets a process tree listens on, read from /proc (what `ss -ltnp` shows).

Why it exists: the listener tests (docs/security.md: nothing binds all interfaces) must look at the
real sockets the kernel holds, not at the addresses the code meant to bind.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

WILDCARDS = {"0.0.0.0", "::"}
"""Addresses that accept connections on every interface."""


def _tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            children = task / "children"
            if children.exists():
                todo += [int(c) for c in children.read_text().split()]
    return found


def _socket_inodes(pids: list[int]) -> set[str]:
    inodes = set()
    for p in pids:
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:  # exited meanwhile
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{p}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def _address(hex_addr: str) -> str:
    """The address of a /proc/net/tcp{,6} local_address field (little-endian 32-bit words)."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(words)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def listening(pid: int | None = None) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state held by process `pid` (default: this one)
    or any of its descendants."""
    inodes = _socket_inodes(_tree(pid or os.getpid()))
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A = TCP_LISTEN
                host, port = local.split(":")
                out.add((_address(host), int(port, 16)))
    return out


def on_all_interfaces(pid: int | None = None) -> set[tuple[str, int]]:
    """The listeners of `listening(pid)` bound to a wildcard address."""
    return {(a, p) for a, p in listening(pid) if a in WILDCARDS}
