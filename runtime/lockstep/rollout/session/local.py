"""Agent functions that bring their own in-process session server (for `lockstep run` on one machine).

Why it exists: in a cluster the driver hands agents the URL of a session-server Service
(AgentContext.session_url). On one machine nothing runs it yet, so these AgentFns start one
SessionServer per process on 127.0.0.1 the first time they run, in front of the driver's engine
client (AgentContext.client, so turns go where the driver's samples go; with several replicas each
session sticks to one of them), and reuse it afterwards. In a driver pod the driver hands the
router Service's EndpointSlices (AgentContext.extra["members"]): each session then sticks to one live
engine pod (LiveReplicaPool) rather than to the Service's load balancing, and to one DP-attention
rank of it when spec.rollout.dataParallelAttention > 1 (extra["dp_size"]).

Manifest: spec.agent.agentFunction: lockstep.rollout.session.local:toolcalc_agent
          spec.agent.rewardFunction: lockstep.tasks.toolcalc:reward
The family comes from AgentContext.extra["family"] (default "tiny"), the tokenizer from
AgentContext.extra["tokenizer_dir"] (the run's checkpoint dir; the driver sets both).

Who calls it: lockstep.rollout.generate (as the configured agent function), tests.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass, field
from typing import Any

from lockstep.api.auth import api_key_from_env
from lockstep.observability.metrics import share_registry
from lockstep.rollout.session.engine import BackendEngine, LiveReplicaPool, ReplicaPool, TurnEngine
from lockstep.rollout.session.server import SessionServer, SessionServerConfig
from lockstep.serving import EngineClient
from lockstep.tasks.toolcalc.agent import run_episode
from lockstep.types import Sample


@dataclass(slots=True)
class _LoopServers:
    """The in-process session servers of one event loop."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Serializes the first start (many agents of a batch arrive at once)."""
    by_client: dict[int, tuple[object, SessionServer]] = field(default_factory=dict)
    """id(engine client) -> (that client, its server); holding the client keeps its id unique."""


# Keyed by the loop object itself, not id(loop): a server or lock of a closed loop must never be handed
# to a later loop (each asyncio.run, each test), whatever ids the objects get.
_per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopServers] = weakref.WeakKeyDictionary()


def turn_engine(client: Any, members: Any = None, dp_size: int = 1) -> TurnEngine:
    """Where the session server sends turns: the live engines of `members` (a driver pod), else
    session affinity over the driver's replicas when its client holds EngineClients (its round-robin
    PoolClient would send every turn elsewhere) and there are several or they run DP attention,
    otherwise the client itself."""
    if members is not None:
        return LiveReplicaPool(members, dp_size=dp_size)
    replicas = getattr(client, "clients", None)
    if (
        isinstance(replicas, list)
        and (len(replicas) > 1 or (replicas and dp_size > 1))
        and all(isinstance(c, EngineClient) for c in replicas)
    ):
        return ReplicaPool(replicas, dp_size=dp_size)
    return BackendEngine(client)


async def session_url_for(ctx: Any) -> str:
    """ctx.session_url, or the URL of this process's in-process session server (started once)."""
    if ctx.session_url:
        return str(ctx.session_url)
    loop = asyncio.get_running_loop()
    servers = _per_loop.get(loop)
    if servers is None:
        servers = _per_loop[loop] = _LoopServers()
    async with servers.lock:
        entry = servers.by_client.get(id(ctx.client))
        if entry is None:
            family = str(ctx.extra.get("family", "tiny"))
            session = ctx.extra.get("session") or {}  # spec.rollout.session: defaults of new sessions
            tokenizer_dir = ctx.extra.get("tokenizer_dir")  # the served checkpoint's tokenizer.json
            config = SessionServerConfig(
                family=family,
                tokenizer_dir=str(tokenizer_dir) if tokenizer_dir else None,
                max_new_tokens=ctx.sampling.max_new_tokens,
                mode=session.get("mode", "linear"),
                matcher=session.get("matcher", "strict"),
                max_nodes=session.get("maxNodes", 256),
                api_key=api_key_from_env(),
            )
            engine = turn_engine(ctx.client, ctx.extra.get("members"), int(ctx.extra.get("dp_size", 1)))
            srv = SessionServer(config, engine)
            await srv.start("127.0.0.1", 0)
            share_registry(srv.metrics.registry)  # on the driver's metrics endpoint (tito_* series)
            entry = servers.by_client[id(ctx.client)] = (ctx.client, srv)
        return entry[1].url


async def toolcalc_agent(ctx: Any, sample: Sample) -> Sample:
    """AgentFn: one toolcalc episode through the session server (see lockstep.tasks.toolcalc)."""
    url = await session_url_for(ctx)
    return await run_episode(
        url,
        sample,
        max_turns=ctx.max_turns or 3,
        max_tokens=ctx.sampling.max_new_tokens,
        temperature=ctx.sampling.temperature,
    )
