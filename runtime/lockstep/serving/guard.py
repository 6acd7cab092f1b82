"""What every Lockstep HTTP server checks before a handler runs: the job's key, the body's size.

Why it exists: the engine, the session server and the trainer command server all change state a
job depends on (weights, versions, sessions, the optimizer). Each requires the job's shared key
(`Authorization: Bearer <key>`, the key from Secret `<job>-api-key` as LOCKSTEP_API_KEY, SGLang's
own --api-key convention) on every route except the read-only GETs it lists, compares it in
constant time, and never logs it. Bodies are capped per server (aiohttp's client_max_size answers
413), JSON is parsed so that hostile nesting is a 400, not a 500, and idle connections close after
IDLE_TIMEOUT_S.

Who calls it: lockstep.engine.server, lockstep.rollout.session.server, lockstep.trainer.server.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from aiohttp import web

from lockstep.serving.client import API_KEY_ENV

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

READ_METHODS = frozenset({"GET", "HEAD"})
IDLE_TIMEOUT_S = 75.0
"""Seconds an idle keep-alive connection stays open on every Lockstep server: aiohttp's run_app default,
which the engine has; an AppRunner's own default is 3630 s, so the session and trainer servers kept idle
connections (and their file descriptors) for an hour. Clients reuse idle connections for less
(lockstep.serving.http.KEEPALIVE_S, httpx's 5 s)."""


def bearer_middleware(api_key: str | None, *, open_reads: Collection[str]) -> Any:
    """An aiohttp middleware requiring `Authorization: Bearer <api_key>` on every request except a
    GET/HEAD of a path in `open_reads` (health, versions, metrics). No key: everything is open."""
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def require_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is None or (request.method in READ_METHODS and request.path in open_reads):
            return await handler(request)
        sent = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(sent, expected):
            return web.json_response(
                {
                    "error": f"{request.method} {request.path} needs the job's key: send "
                    f"'Authorization: Bearer <key>' with the key from ${API_KEY_ENV}"
                },
                status=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return require_key


def parse_json(raw: bytes) -> Any:
    """JSON bytes -> Python; ValueError (naming the problem) for bad JSON, hostile nesting included."""
    try:
        return json.loads(raw) if raw else {}
    except RecursionError as e:
        raise ValueError("request body nests too deeply") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"request body is not UTF-8: {e}") from e
