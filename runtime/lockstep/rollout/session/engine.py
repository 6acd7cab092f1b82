"""How the session server reaches the rollout engines: one replica per session, token in, token out.

Why it exists: every turn of a session must reach the same replica so its prefix cache already holds
the previous checkpoint (§3). `ReplicaPool` picks the replica by consistent hashing of the
session id (and, for DP-attention replicas, the DP rank, sent as `routed_dp_rank`) and sends the
SGLang /generate payload (lockstep.serving's models) with the X-SMG-Routing-Key header, so a router
in front of several replicas keeps the same stickiness.
`LiveReplicaPool` does the same over replicas that come and go (in a cluster: the ready endpoints of
the pool's router Service, lockstep.serving.membership.EndpointSliceMembers): a session stays on the
replica of its first turn and moves only when that replica has left (affinity.place); it counts the
turns each replica served and the sessions that moved.
`BackendEngine` adapts any lockstep.serving.GenerateBackend (e.g. an EngineClient of one replica)
for in-process use.

Who calls it: lockstep.rollout.session.server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from lockstep.rollout.session.affinity import ROUTING_HEADER, HashRing, Route, place
from lockstep.serving import EngineClient, GenerateBackend, GenerateResult, SamplingParams
from lockstep.serving.client import EngineUnreachable
from lockstep.serving.membership import EngineMembers

log = logging.getLogger(__name__)


class TurnEngine(Protocol):
    """Samples one turn of a session."""

    async def generate(
        self, session_id: str, input_ids: Sequence[int], sampling: SamplingParams, routed_experts: bool
    ) -> GenerateResult:
        """Sample a continuation of input_ids with logprobs (and routing data when asked)."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


class ReplicaPool:
    """Replicas behind consistent hashing of the session id, one EngineClient each."""

    def __init__(
        self, replicas: Sequence[str | EngineClient], timeout_s: float = 600.0, dp_size: int = 1
    ) -> None:
        # One client per replica: each tracks its replica's last weight version, which is what lets
        # result_from_reply trust stock SGLang's single per-reply version for every token. No retry:
        # a dead replica fails the turn at once (the agent sees a 502). Clients passed in (e.g. the
        # driver's) are used as they are and stay open at aclose: their owner closes them.
        self._owned = [
            EngineClient(r, timeout_s=timeout_s, retries=1) for r in replicas if isinstance(r, str)
        ]
        given = [r for r in replicas if isinstance(r, EngineClient)]
        self._clients = {c.base_url: c for c in [*given, *self._owned]}
        self.ring = HashRing(list(self._clients), dp_size=dp_size)
        """Session id -> (replica URL, DP rank); dp_size is each replica's SGLang --dp-size."""

    async def generate(
        self, session_id: str, input_ids: Sequence[int], sampling: SamplingParams, routed_experts: bool
    ) -> GenerateResult:
        replica, dp_rank = self.ring.route(session_id)
        return await self._clients[replica].generate(
            input_ids,
            sampling,
            return_logprob=True,
            return_routed_experts=routed_experts,
            routed_dp_rank=dp_rank,
            headers={ROUTING_HEADER: session_id},
        )

    async def aclose(self) -> None:
        for client in self._owned:
            await client.aclose()


class LiveReplicaPool:
    """Sessions pinned to the replicas `members` lists now (asked at most every `refresh_s`, and at
    once when a pinned replica stops answering); a session moves only when its replica is gone."""

    def __init__(
        self,
        members: EngineMembers,
        *,
        dp_size: int = 1,
        refresh_s: float = 2.0,
        timeout_s: float = 600.0,
        max_sessions: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if dp_size < 1:
            raise ValueError(
                f"dp_size={dp_size}: a replica has at least one DP rank (spec.rollout.dataParallelAttention)"
            )
        self.members = members
        """Where the live replicas come from (the router Service's EndpointSlices in a driver pod)."""
        self.dp_size = dp_size
        """DP-attention ranks per replica (spec.rollout.dataParallelAttention)."""
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._ring: HashRing | None = None
        self._asked = -float("inf")
        self._lock = asyncio.Lock()
        self._pins: OrderedDict[str, Route] = OrderedDict()
        self._clients: dict[str, EngineClient] = {}
        self.turns: Counter[str] = Counter()
        """Turns served, per replica URL."""
        self.moved = 0
        """Sessions that moved because their replica was gone."""

    async def ring(self, *, force: bool = False) -> HashRing:
        """The ring over the live replicas (the last one known while the source fails or lists none)."""
        async with self._lock:
            if force or self._ring is None or self._clock() - self._asked >= self.refresh_s:
                self._asked = self._clock()
                try:
                    urls = await asyncio.to_thread(self.members.urls)
                except OSError as e:
                    urls = []
                    log.warning("live engines not refreshed from %s: %s", self.members.describe(), e)
                if urls and (self._ring is None or urls != self._ring.replicas):
                    log.info("session routing over %d engine(s): %s", len(urls), ", ".join(urls))
                    self._ring = HashRing(urls, dp_size=self.dp_size)
            if self._ring is None:
                raise EngineUnreachable(self.members.describe(), 1, LookupError("no live engine listed"))
            return self._ring

    def _route(self, session_id: str, ring: HashRing) -> Route:
        route, moved = place(session_id, self._pins.get(session_id), ring)
        if moved:
            self.moved += 1
            log.info("session %s moved to %s: its engine is gone", session_id, route[0])
        self._pins[session_id] = route
        self._pins.move_to_end(session_id)
        while len(self._pins) > self.max_sessions:  # the oldest sessions have ended long ago
            self._pins.popitem(last=False)
        return route

    def _client(self, url: str) -> EngineClient:
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = EngineClient(url, timeout_s=self.timeout_s, retries=1)
        return client

    async def generate(
        self, session_id: str, input_ids: Sequence[int], sampling: SamplingParams, routed_experts: bool
    ) -> GenerateResult:
        route = self._route(session_id, await self.ring())
        try:
            return await self._send(session_id, route, input_ids, sampling, routed_experts)
        except EngineUnreachable:
            ring = await self.ring(force=True)  # is it gone, or only slow to answer?
            if route[0] in ring.replicas:
                raise
            route = self._route(session_id, ring)  # gone: this turn goes to the session's new replica
            return await self._send(session_id, route, input_ids, sampling, routed_experts)

    async def _send(
        self, session_id: str, route: Route, input_ids: Sequence[int], sampling: SamplingParams, routed: bool
    ) -> GenerateResult:
        replica, dp_rank = route
        result = await self._client(replica).generate(
            input_ids,
            sampling,
            return_logprob=True,
            return_routed_experts=routed,
            routed_dp_rank=dp_rank,
            headers={ROUTING_HEADER: session_id},
        )
        self.turns[replica] += 1
        return result

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()


class BackendEngine:
    """One in-process GenerateBackend (a single replica: affinity is trivial)."""

    def __init__(self, backend: GenerateBackend) -> None:
        self.backend = backend
        """The wrapped backend (e.g. lockstep.serving.EngineClient)."""

    async def generate(
        self, session_id: str, input_ids: Sequence[int], sampling: SamplingParams, routed_experts: bool
    ) -> GenerateResult:
        return await self.backend.generate(
            input_ids, sampling, return_logprob=True, return_routed_experts=routed_experts
        )

    async def aclose(self) -> None:
        return None
