"""The in-process session server of `lockstep.rollout.session.local`: one per event loop and client,
sticky per session over the driver's replicas.

Each asyncio.run is a new loop (as each test is); a server started on an earlier, closed loop
must never be handed out again (it would never answer), and within one loop the server is reused.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
from lockstep.rollout.session.engine import BackendEngine, ReplicaPool
from lockstep.rollout.session.local import session_url_for, turn_engine
from lockstep.serving import EngineClient, SamplingParams


async def _url_then_create_a_session(ctx: SimpleNamespace) -> tuple[str, str]:
    url = await session_url_for(ctx)
    assert await session_url_for(ctx) == url  # reused within the loop
    async with httpx.AsyncClient(timeout=5.0) as h:
        resp = await h.post(f"{url}/sessions", json={})
    assert resp.status_code == 200, resp.text
    return url, resp.json()["session_id"]


def test_each_loop_gets_a_live_server() -> None:
    client = object()  # never called: no turn is generated
    ctx = SimpleNamespace(
        session_url=None, client=client, extra={}, sampling=SamplingParams(max_new_tokens=8)
    )
    urls = [asyncio.run(_url_then_create_a_session(ctx))[0] for _ in range(4)]
    assert len(set(urls)) == 4  # a fresh server on every loop, each answering on its own loop


def test_driver_replicas_get_session_affinity_and_stay_open() -> None:
    clients = [EngineClient("http://127.0.0.1:1"), EngineClient("http://127.0.0.1:2")]
    engine = turn_engine(SimpleNamespace(clients=clients))  # the driver's round-robin PoolClient shape
    assert isinstance(engine, ReplicaPool)
    assert sorted(engine.ring.replicas) == [c.base_url for c in clients]
    asyncio.run(engine.aclose())
    assert not any(c.closed for c in clients)  # the driver owns and closes them
    assert isinstance(turn_engine(SimpleNamespace(clients=clients[:1])), BackendEngine)
    assert isinstance(turn_engine(clients[0]), BackendEngine)
    for c in clients:
        asyncio.run(c.aclose())
