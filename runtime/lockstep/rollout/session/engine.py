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

import uuid
from collections.abc import Sequence
from typing import Protocol

import httpx

from lockstep.rollout.session.affinity import ROUTING_HEADER, HashRing
from lockstep.serving import GenerateBackend, GenerateReply, GenerateRequest, GenerateResult, SamplingParams
from lockstep.serving.client import EngineError, result_from_reply


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
    """Replicas behind consistent hashing of the session id, reached over HTTP."""

    def __init__(self, replicas: Sequence[str], timeout_s: float = 600.0, dp_size: int = 1) -> None:
        self.ring = HashRing([r.rstrip("/") for r in replicas], dp_size=dp_size)
        """Session id -> (replica URL, DP rank); dp_size is each replica's SGLang --dp-size."""
        self._http = httpx.AsyncClient(timeout=timeout_s)
        self._last_version: dict[str, int | None] = {}

    async def generate(
        self, session_id: str, input_ids: Sequence[int], sampling: SamplingParams, routed_experts: bool
    ) -> GenerateResult:
        replica, dp_rank = self.ring.route(session_id)
        url = replica + "/generate"
        req = GenerateRequest(
            input_ids=list(input_ids),
            sampling_params=sampling,
            return_logprob=True,
            return_routed_experts=routed_experts,
            rid=uuid.uuid4().hex,
            routed_dp_rank=dp_rank,
        )
        resp = await self._http.post(
            url, json=req.model_dump(mode="json", exclude_none=True), headers={ROUTING_HEADER: session_id}
        )
        if resp.status_code >= 400:
            raise EngineError(url, resp.status_code, resp.text[:500])
        # Stock SGLang reports one weight_version per reply; result_from_reply only trusts it for
        # every token when this replica reported the same version before the request was sent.
        result = result_from_reply(GenerateReply.model_validate(resp.json()), self._last_version.get(replica))
        self._last_version[replica] = result.weight_version
        return result

    async def aclose(self) -> None:
        await self._http.aclose()


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
