"""Session affinity: every turn of a session goes to the same engine replica.

Why it exists (seed §3, throughput): the replica that served turn k holds C_k in its prefix (KV)
cache, so turn k+1 only prefills the appended suffix. We pick the replica by consistent hashing of
the session id over the replica URLs (adding or removing a replica moves only ~1/n of the sessions),
and also send the session id as the `X-SMG-Routing-Key` header, which SGLang's router (sgl-router,
policies `consistent_hashing` and `manual`) uses for the same stickiness when a router sits in front.

Who calls it: lockstep.rollout.session.server. Pure.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import xxhash

ROUTING_HEADER = "X-SMG-Routing-Key"
"""sgl-router's session-affinity header (read by its consistent_hashing and manual policies)."""


class HashRing:
    """Consistent-hash ring of replica URLs with virtual nodes."""

    def __init__(self, replicas: Sequence[str], vnodes: int = 64) -> None:
        if not replicas:
            raise ValueError("replicas is empty; give at least one engine URL")
        self.replicas = list(replicas)
        """Replica base URLs, e.g. http://127.0.0.1:30000."""
        points = sorted(
            (xxhash.xxh64_intdigest(f"{r}#{v}".encode()), r) for r in self.replicas for v in range(vnodes)
        )
        self._keys = [p for p, _ in points]
        self._owners = [r for _, r in points]

    def pick(self, session_id: str) -> str:
        """The replica that serves every turn of `session_id`."""
        h = xxhash.xxh64_intdigest(session_id.encode())
        i = bisect.bisect_right(self._keys, h) % len(self._keys)
        return self._owners[i]
