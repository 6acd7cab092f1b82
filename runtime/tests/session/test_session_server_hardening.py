"""The session server under hostile input, in front of a real reference engine on 127.0.0.1.

Each row of the table gets its status while an existing session stays exactly as it was and the
server goes on serving it; without the job's key every route but /metrics is 401; session and body
caps hold. (Tokenizing, parsing and rendering run on the server's worker threads; that a huge body
no longer stalls other sessions is not asserted here, a timing claim is not a test.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest_asyncio
from lockstep.rollout.session.engine import ReplicaPool
from lockstep.rollout.session.server import SessionServer, SessionServerConfig

KEY = "session-test-key"
USER = {"role": "user", "content": "hi"}


@pytest_asyncio.fixture
async def server(engine_url: str) -> AsyncIterator[SessionServer]:
    config = SessionServerConfig(
        family="tiny", temperature=0.0, max_new_tokens=8, api_key=KEY, max_sessions=8, max_body_bytes=1 << 20
    )
    srv = SessionServer(config, ReplicaPool([engine_url]))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


@pytest_asyncio.fixture
async def http(server: SessionServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
    ) as h:
        yield h


async def _session_with_a_turn(http: httpx.AsyncClient) -> tuple[str, dict[str, Any]]:
    sid = (await http.post("/sessions", json={})).json()["session_id"]
    r = await http.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": [USER]})
    assert r.status_code == 200, r.text
    return sid, (await http.get(f"/sessions/{sid}")).json()


def _nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


def _rows(sid: str) -> list[tuple[str, str, str, Any, dict[str, str] | None, int]]:
    """(row, method, path, body, headers or None for the key, status)."""
    chat = f"/sessions/{sid}/v1/chat/completions"
    no_key: dict[str, str] = {}
    wrong = {"Authorization": "Bearer nope"}
    return [
        ("create without key", "POST", "/sessions", {}, no_key, 401),
        ("chat without key", "POST", chat, {"messages": [USER]}, no_key, 401),
        ("chat with a wrong key", "POST", chat, {"messages": [USER]}, wrong, 401),
        ("samples without key", "POST", f"/sessions/{sid}/samples", {}, no_key, 401),
        ("delete without key", "DELETE", f"/sessions/{sid}", None, no_key, 401),
        ("read without key", "GET", f"/sessions/{sid}", None, no_key, 401),
        ("metrics are open", "GET", "/metrics", None, no_key, 200),
        (
            "body 2 MiB",
            "POST",
            chat,
            b'{"messages": [{"role": "user", "content": "' + b"a" * (2 << 20) + b'"}]}',
            None,
            413,
        ),
        ("nested JSON 100k", "POST", chat, _nested(100_000), None, 400),
        ("not JSON", "POST", chat, b"\xff{", None, 400),
        ("token ids", "POST", chat, {"messages": [USER], "input_ids": [1, 2]}, None, 400),
        ("seed 2**70", "POST", chat, {"messages": [USER], "seed": 2**70}, None, 400),
        (
            "temperature NaN",
            "POST",
            chat,
            b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
            None,
            400,
        ),
        # float32 underflow: the engine's sampling step used to throw, and the turn came back as
        # `stop` with 0 tokens (the engine's other requests of that step aborted)
        ("temperature 1e-40", "POST", chat, {"messages": [USER], "temperature": 1e-40}, None, 400),
        ("top_p 1e-300", "POST", chat, {"messages": [USER], "top_p": 1e-300}, None, 400),
        ("max_tokens 2**40", "POST", chat, {"messages": [USER], "max_tokens": 2**40}, None, 400),
        ("n=2", "POST", chat, {"messages": [USER], "n": 2}, None, 400),
        ("bad role", "POST", chat, {"messages": [{"role": "root", "content": "x"}]}, None, 400),
        ("unknown session", "POST", "/sessions/nope/v1/chat/completions", {"messages": [USER]}, None, 404),
        ("bad mode", "POST", "/sessions", {"mode": "forever"}, None, 400),
        ("max_nodes 10**9", "POST", "/sessions", {"max_nodes": 10**9}, None, 400),
    ]


async def test_hostile_input_table(server: SessionServer, http: httpx.AsyncClient) -> None:
    sid, state = await _session_with_a_turn(http)
    open_before = set(server.sessions)
    for row, method, path, body, headers, status in _rows(sid):
        kw: dict[str, Any] = (
            {"content": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
        )
        if headers is None:
            r = await http.request(method, path, **kw)
        else:  # a client of its own: without the key, or with a wrong one
            async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as anon:
                r = await anon.request(method, path, **kw)
        assert r.status_code == status, f"{row}: {r.status_code} {r.text[:300]}"
        assert KEY not in r.text, row
        assert set(server.sessions) == open_before, row  # nothing created, nothing deleted
        assert (await http.get(f"/sessions/{sid}")).json() == state, row  # the session is untouched
    # ... and it still serves: the next turn of that session goes through.
    r = await http.post(
        f"/sessions/{sid}/v1/chat/completions",
        json={"messages": [USER, {"role": "assistant", "content": _reply(server, sid)}, USER]},
    )
    assert r.status_code == 200, r.text


def _reply(server: SessionServer, sid: str) -> str:
    head = server.sessions[sid].tree.head
    assert head is not None
    return server.family.parse_reply(server.family.codec.decode(head.ids[head.prompt_len :])).content


async def test_the_session_cap_answers_503(server: SessionServer, http: httpx.AsyncClient) -> None:
    for _ in range(server.config.max_sessions):
        assert (await http.post("/sessions", json={})).status_code == 200
    full = await http.post("/sessions", json={})
    assert full.status_code == 503 and "max_sessions" in full.text
    assert len(server.sessions) == server.config.max_sessions
