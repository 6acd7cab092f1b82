"""JsonHttp: the HTTP layer under EngineClient (aiohttp, one pooled session per event loop).

Why it exists: a rollout step sends one /generate per sample, so the client's cost per request is paid
hundreds of times a step. httpx (the previous layer) cost ~2.3 ms of CPU per request on loopback with
a fresh connection each (its pool scan made keep-alive slower still); aiohttp with keep-alive costs
~0.45 ms (bench/engine_client_http.py). On a small machine the client shares the cores (and the GIL)
with the engine and the trainer, so this is rollout time saved.

Why one session per loop: an aiohttp session and its pooled connections belong to the loop that
opened them, and one EngineClient may be used from several loops (built in one thread, driven from the
driver's asyncio thread; tests run several asyncio.run calls). Sessions of loops that have closed are
dropped without touching their dead transports.

Keep-alive: idle connections are reused for at most KEEPALIVE_S, well below the idle timeouts of
SGLang's server (uvicorn, 5 s) and ours, so a reused connection is never one the server is closing.

Errors: a failed connect raises ConnectFailed (nothing was sent: safe to retry); a connection that
breaks or times out after the request was sent raises NoReply (the server may have run it: never
retried by callers). Both keep the aiohttp error as __cause__.

Who calls it: lockstep.serving.client.EngineClient.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

KEEPALIVE_S = 2.0
"""Seconds an idle pooled connection may be reused (below every server's idle timeout)."""

MAX_CONNECTIONS = 1024
"""Connections open at once per loop (a rollout wave of 1024 samples runs unqueued)."""


class ConnectFailed(ConnectionError):
    """No connection to the server: the request was not sent."""


class NoReply(ConnectionError):
    """The request was sent but no complete reply came (connection lost, or no reply within the timeout)."""

    def __init__(self, url: str, cause: BaseException) -> None:
        what = "no reply within the timeout" if isinstance(cause, TimeoutError) else "connection lost"
        super().__init__(f"{url}: {what} after the request was sent ({type(cause).__name__}: {cause})")
        self.url = url
        """The URL of the request."""


@dataclass(slots=True, frozen=True)
class Reply:
    """One HTTP reply, read whole."""

    status_code: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON; raises ValueError when it is not JSON."""
        return json.loads(self.body)


class JsonHttp:
    """JSON over HTTP with pooled keep-alive connections, usable from any event loop.

    timeout_s: for connecting and for each read (the reply of a long generation may take minutes);
    headers: sent with every request (e.g. the bearer token).
    """

    def __init__(self, *, timeout_s: float, headers: Mapping[str, str]) -> None:
        self._timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s)
        self._headers = dict(headers)
        self._sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = (
            weakref.WeakKeyDictionary()
        )
        self.closed = False
        """True after aclose(); later requests raise RuntimeError."""

    def _session(self) -> aiohttp.ClientSession:
        if self.closed:
            raise RuntimeError("this client was closed (aclose); open a new one")
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None:
            self._drop_dead_loops()
            connector = aiohttp.TCPConnector(limit=MAX_CONNECTIONS, keepalive_timeout=KEEPALIVE_S)
            session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, headers=self._headers)
            self._sessions[loop] = session
        return session

    def _drop_dead_loops(self) -> None:
        for loop in [lp for lp in self._sessions if lp.is_closed()]:
            _forget(loop, self._sessions.pop(loop))

    async def request(
        self, method: str, url: str, payload: Any = None, *, headers: Mapping[str, str] | None = None
    ) -> Reply:
        """Send one request (payload as JSON when not None) and read the whole reply."""
        session = self._session()
        try:
            async with session.request(method, url, json=payload, headers=headers) as resp:
                return Reply(resp.status, await resp.read())
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:  # nothing was sent
            raise ConnectFailed(f"{url}: {e}") from e
        except (aiohttp.ClientError, TimeoutError) as e:
            raise NoReply(url, e) from e

    async def aclose(self) -> None:
        """Close this loop's session; sessions of other loops are dropped (their loops own them)."""
        self.closed = True
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        for lp, session in list(self._sessions.items()):
            if lp is loop:
                await session.close()
            else:
                _forget(lp, session)
        self._sessions.clear()


def _forget(loop: asyncio.AbstractEventLoop, session: aiohttp.ClientSession) -> None:
    """Let go of another loop's session: closed on its own loop when that one still runs, else dropped
    (its transports died with their loop) without an "unclosed session" report."""
    if loop.is_running():
        asyncio.run_coroutine_threadsafe(session.close(), loop)
        return
    connector = session.connector
    session.detach()
    if connector is not None and not connector.closed:
        connector._close()  # private: marks it closed and forgets the dead connections, synchronously
