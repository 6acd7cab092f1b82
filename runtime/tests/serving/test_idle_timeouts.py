"""Idle keep-alive connections close on every Lockstep server as they do on the engine (75 s).

The session and trainer servers ran on aiohttp AppRunners, whose default idle timeout is 3630 s: an
idle client held a connection (and a file descriptor) for an hour. Here each real server, started the
way its process starts it, gets a short idle timeout and a raw keep-alive connection: it must close it.
"""

from __future__ import annotations

import asyncio
import inspect
import socket

from aiohttp import web
from lockstep.rollout.session.engine import ReplicaPool
from lockstep.rollout.session.server import SessionServer, SessionServerConfig
from lockstep.serving.guard import IDLE_TIMEOUT_S
from lockstep.trainer.server import CommandServer, _serve_http


def test_every_server_defaults_to_the_engines_idle_timeout() -> None:
    engine_default = inspect.signature(web.run_app).parameters["keepalive_timeout"].default  # cli/engine
    assert IDLE_TIMEOUT_S == engine_default == 75.0
    assert SessionServerConfig(family="tiny").idle_timeout_s == IDLE_TIMEOUT_S
    assert CommandServer(None, "job", 1).idle_timeout_s == IDLE_TIMEOUT_S


def _closes_when_idle(port: int, path: str) -> bytes:
    """One keep-alive request, then idle: returns what arrives after the reply (b"" once closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n".encode())
        head = sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        tail = b""
        while chunk := sock.recv(65536):  # hang guard: the 60 s socket timeout raises
            tail += chunk
        return tail


async def test_the_session_server_closes_idle_connections() -> None:
    server = SessionServer(
        SessionServerConfig(family="tiny", idle_timeout_s=0.5), ReplicaPool(["http://127.0.0.1:9"])
    )
    url = await server.start()
    try:
        port = int(url.rsplit(":", 1)[1])
        await asyncio.to_thread(_closes_when_idle, port, "/metrics")
    finally:
        await server.stop()


async def test_the_trainer_command_server_closes_idle_connections() -> None:
    server = CommandServer(None, "job", 1, idle_timeout_s=0.5)
    ports: list[int] = []
    serving = asyncio.create_task(_serve_http(server, "127.0.0.1", 0, ports.append))
    while not ports:
        await asyncio.sleep(0.01)
    try:
        await asyncio.to_thread(_closes_when_idle, ports[0], "/v2/health")
    finally:
        server.done.set()
        await serving
