"""The in-process session server of `lockstep.rollout.session.local`: one per event loop and client.

Each asyncio.run is a new loop (as each test is); a server started on an earlier, closed loop
must never be handed out again (it would never answer), and within one loop the server is reused.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
from lockstep.rollout.session.local import session_url_for
from lockstep.serving import SamplingParams


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
