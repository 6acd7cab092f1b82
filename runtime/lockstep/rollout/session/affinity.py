"""Session affinity: every turn of a session goes to the same engine replica.

Why it exists (§3, throughput): the replica that served turn k holds C_k in its prefix (KV)
cache, so turn k+1 only prefills the appended suffix. We pick the replica by consistent hashing of
the session id over the replica URLs (adding or removing a replica moves only ~1/n of the sessions),
and also send the session id as the `X-SMG-Routing-Key` header, which SGLang's router (sgl-router,
policies `consistent_hashing` and `manual`) uses for the same stickiness when a router sits in front.
A replica that runs DP attention (`--dp-size N`) has N schedulers with N separate prefix caches, so
with `dp_size > 1` the ring's nodes are (replica, DP rank) pairs and the session server sends the
rank as SGLang's `routed_dp_rank`; with one rank nothing is sent and the engine chooses.

In a cluster the replicas come and go (lockstep.rollout.session.engine.LiveReplicaPool asks the
router Service's EndpointSlices): `place` keeps each session on the (replica, rank) of its first turn
while that replica is live, and moves it (by the ring over the live replicas) only when it is gone, so
a new engine joining takes only new sessions and never cools a running session's cache.

Who calls it: lockstep.rollout.session.engine. Pure.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TypeAlias

import xxhash

Route: TypeAlias = tuple[str, int | None]
"""(replica URL, DP rank; None when the engine picks the rank)."""

ROUTING_HEADER = "X-SMG-Routing-Key"
"""sgl-router's session-affinity header (read by its consistent_hashing and manual policies)."""


def _node_key(replica: str, rank: int, vnode: int) -> bytes:
    # Rank 0 keeps the one-rank key, so turning DP routing on moves no session off its replica's rank 0.
    return (f"{replica}#{vnode}" if rank == 0 else f"{replica}@{rank}#{vnode}").encode()


class HashRing:
    """Consistent-hash ring of (replica URL, DP rank) nodes with virtual nodes."""

    def __init__(self, replicas: Sequence[str], vnodes: int = 64, dp_size: int = 1) -> None:
        if not replicas:
            raise ValueError("replicas is empty; give at least one engine URL")
        if dp_size < 1:
            raise ValueError(f"dp_size={dp_size}: a replica has at least one DP rank (pass its --dp-size)")
        self.replicas = list(replicas)
        """Replica base URLs, e.g. http://127.0.0.1:30000."""
        self.dp_size = dp_size
        """DP-attention ranks per replica (SGLang's --dp-size); 1 means the engine picks the rank."""
        points = sorted(
            (xxhash.xxh64_intdigest(_node_key(r, rank, v)), r, rank)
            for r in self.replicas
            for rank in range(dp_size)
            for v in range(vnodes)
        )
        self._keys = [p for p, _, _ in points]
        self._owners = [(r, rank) for _, r, rank in points]

    def route(self, session_id: str) -> tuple[str, int | None]:
        """(replica, DP rank) that serve every turn of `session_id`; the rank is None when dp_size is 1."""
        h = xxhash.xxh64_intdigest(session_id.encode())
        i = bisect.bisect_right(self._keys, h) % len(self._keys)
        replica, rank = self._owners[i]
        return replica, (rank if self.dp_size > 1 else None)

    def pick(self, session_id: str) -> str:
        """The replica that serves every turn of `session_id`."""
        return self.route(session_id)[0]


def place(session_id: str, pinned: Route | None, ring: HashRing) -> tuple[Route, bool]:
    """Where the next turn of `session_id` goes, and whether the session moved (pure): its `pinned`
    route while that replica is among the ring's (live) replicas, else the ring's choice; moved is
    True only when it had a pin whose replica is gone."""
    if pinned is not None and pinned[0] in ring.replicas and (pinned[1] is None) == (ring.dp_size == 1):
        return pinned, False
    return ring.route(session_id), pinned is not None
