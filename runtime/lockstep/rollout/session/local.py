"""Agent functions that bring their own in-process session server (for `lockstep run` on one machine).

Why it exists: in a cluster the driver hands agents the URL of a session-server Service
(AgentContext.session_url). On one machine nothing runs it yet, so these AgentFns start one
SessionServer per process on 127.0.0.1 the first time they run, in front of the driver's engine
client (AgentContext.client, so turns go where the driver's samples go), and reuse it afterwards.

Manifest: spec.agent.agentFunction: lockstep.rollout.session.local:toolcalc_agent
          spec.agent.rewardFunction: lockstep.tasks.toolcalc:reward
The family comes from AgentContext.extra["family"] (default "tiny").

Who calls it: lockstep.rollout.generate (as the configured agent function), tests.
"""

from __future__ import annotations

import asyncio
from typing import Any

from lockstep.rollout.session.engine import BackendEngine
from lockstep.rollout.session.server import SessionServer, SessionServerConfig
from lockstep.tasks.toolcalc.agent import run_episode
from lockstep.types import Sample

_servers: dict[tuple[int, int], SessionServer] = {}
_locks: dict[int, asyncio.Lock] = {}


async def session_url_for(ctx: Any) -> str:
    """ctx.session_url, or the URL of this process's in-process session server (started once)."""
    if ctx.session_url:
        return str(ctx.session_url)
    loop = id(asyncio.get_running_loop())
    async with _locks.setdefault(loop, asyncio.Lock()):
        key = (loop, id(ctx.client))
        srv = _servers.get(key)
        if srv is None:
            family = str(ctx.extra.get("family", "tiny"))
            config = SessionServerConfig(family=family, max_new_tokens=ctx.sampling.max_new_tokens)
            srv = SessionServer(config, BackendEngine(ctx.client))
            await srv.start("127.0.0.1", 0)
            _servers[key] = srv
        return srv.url


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
