"""The engine client's HTTP layer (lockstep.serving.http) against real aiohttp servers on loopback.

What must hold: connections are reused (the reason for the layer), a request whose connection breaks
after it was sent is never sent again (the engine may have run it), a refused connect is retried, one
client works from several event loops, and closing leaves nothing unclosed.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from lockstep.serving import EngineClient, EngineUnreachable, NoReply
from lockstep.serving.http import JsonHttp


class _Seen:
    """What a test server saw: requests per path and the client ports they came from."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.peers: set[int] = set()


@asynccontextmanager
async def _server(seen: _Seen, *, drop: bool = False) -> AsyncIterator[str]:
    """An aiohttp server answering /model_info; with drop, /generate closes the connection unanswered."""

    async def model_info(req: web.Request) -> web.Response:
        seen.paths.append(req.path)
        seen.peers.add(req.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        return web.json_response({"model_path": "m", "weight_version": "3"})

    async def generate(req: web.Request) -> web.Response:
        seen.paths.append(req.path)
        await req.read()
        if drop:
            req.transport.close()  # type: ignore[union-attr]
        return web.json_response({"error": "never sent"}, status=500)

    app = web.Application()
    app.router.add_get("/model_info", model_info)
    app.router.add_post("/generate", generate)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def test_connections_are_reused() -> None:
    seen = _Seen()
    async with _server(seen) as url, EngineClient(url) as client:
        for _ in range(5):
            assert (await client.model_info()).weight_version == "3"
    assert len(seen.paths) == 5
    assert len(seen.peers) == 1  # one kept-alive connection, not one per request


async def test_a_request_that_lost_its_connection_is_not_sent_again() -> None:
    seen = _Seen()
    async with _server(seen, drop=True) as url, EngineClient(url, retries=5, backoff_s=0.01) as client:
        with pytest.raises(NoReply, match="/generate: connection lost after the request was sent"):
            await client.generate([1, 2, 3])
    assert seen.paths == ["/generate"]  # retries are for connects only: the engine may have run it


async def test_a_refused_connect_is_retried_then_names_the_url() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: every connect is refused
        waits: list[float] = []

        async def no_wait(d: float) -> None:
            waits.append(d)

        client = EngineClient(f"http://127.0.0.1:{port}", retries=3, backoff_s=0.1, sleep=no_wait)
        with pytest.raises(EngineUnreachable, match=f"127.0.0.1:{port}/model_info unreachable after 3"):
            await client.model_info()
        await client.aclose()
    assert waits == [0.1, 0.2]


def test_one_client_serves_several_loops_and_closes_clean(caplog: pytest.LogCaptureFixture) -> None:
    """Built outside any loop, used from three asyncio.run loops, closed from the last one."""
    seen = _Seen()
    http = JsonHttp(timeout_s=30, headers={})

    async def call(url: str) -> Any:
        return (await http.request("GET", url + "/model_info")).json()

    async def serve_and_call(close: bool) -> None:
        async with _server(seen) as url:
            assert (await call(url))["weight_version"] == "3"
            if close:
                await http.aclose()

    caplog.set_level(logging.ERROR, logger="asyncio")
    for last in (False, False, True):
        asyncio.run(serve_and_call(close=last))
    gc.collect()
    assert http.closed and len(seen.paths) == 3
    assert not [r for r in caplog.records if "Unclosed" in r.getMessage()]
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(call("http://127.0.0.1:1"))
