"""How the session server reaches the rollout engines: one replica per session, token in, token out.

Why it exists: every turn of a session must reach the same replica so its prefix cache already holds
the previous checkpoint (seed §3). `ReplicaPool` picks the replica by consistent hashing of the
session id (and, for DP-attention replicas, the DP rank, sent as `routed_dp_rank`) and sends the
SGLang /generate payload (lockstep.serving's models) with the X-SMG-Routing-Key header, so a router
in front of several replicas keeps the same stickiness.
`BackendEngine` adapts any lockstep.serving.GenerateBackend (e.g. an EngineClient of one replica)
for in-process use.

Who calls it: lockstep.rollout.session.server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from lockstep.rollout.session.affinity import ROUTING_HEADER, HashRing
from lockstep.serving import EngineClient, GenerateBackend, GenerateResult, SamplingParams


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
