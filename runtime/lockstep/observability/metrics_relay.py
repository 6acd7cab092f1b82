"""A read-only relay: GET /metrics answers with another endpoint's /metrics text (SGLang engine pods).

Why it exists: every job pod serves its Prometheus series on port `metrics` (9400), the one port each
job NetworkPolicy admits from any source (it serves only /metrics). SGLang serves its `sglang:*`
series (`--enable-metrics`) at GET /metrics of its HTTP port, which also serves /generate and the
weight routes, so the engine policy admits that port only from the job's driver and trainer pods. A
sidecar of each SGLang engine pod (`lockstep metrics-relay`) fetches the engine's /metrics on the pod
IP and serves it on the `metrics` port, so the engine PodMonitor and scrape job collect it there
(docs/monitoring.md). SGLang lets /metrics through without the API key, so the relay holds none.

Contract: only GET /metrics (HEAD with it) is served, anything else is 404 or 405; the source is
fetched once per scrape with a timeout and at most `max_bytes` of body; its Content-Type is kept and
the scraper's Accept header passed on. When the source is down, times out, answers non-200 or sends
too much: 502 with one line naming the source and the reason (Prometheus marks the target down).

Who calls it: lockstep.cli.metrics_relay (the sidecar the operator renders, resources.metrics_relay).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

MAX_BYTES = 16 * 1024 * 1024
"""Default bound of a relayed body (SGLang's series with all their histograms are far below it)."""
TIMEOUT_S = 10.0
"""Default bound of one fetch of the source, in seconds (Prometheus' default scrape timeout)."""

_SESSION = web.AppKey("session", aiohttp.ClientSession)


def relay_app(source: str, *, timeout_s: float = TIMEOUT_S, max_bytes: int = MAX_BYTES) -> web.Application:
    """The relay's application: GET /metrics answers with `source`'s body (see the module's contract)."""

    async def metrics(request: web.Request) -> web.Response:
        headers = {"Accept": request.headers["Accept"]} if "Accept" in request.headers else {}
        try:
            async with request.app[_SESSION].get(source, headers=headers, allow_redirects=False) as r:
                if r.status != 200:
                    return _bad_gateway(source, f"answered HTTP {r.status}")
                body = await _read_at_most(r.content, max_bytes)
                if body is None:
                    return _bad_gateway(source, f"sent more than {max_bytes} bytes")
                content_type = r.headers.get("Content-Type", "text/plain; version=0.0.4")
        except TimeoutError:
            return _bad_gateway(source, f"did not answer within {timeout_s:g} s")
        except aiohttp.ClientError as e:
            return _bad_gateway(source, f"unreachable ({type(e).__name__}: {e})")
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def session(app: web.Application) -> AsyncIterator[None]:
        app[_SESSION] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))
        yield
        await app[_SESSION].close()

    app = web.Application()
    app.cleanup_ctx.append(session)
    app.router.add_get("/metrics", metrics)
    return app


async def _read_at_most(stream: aiohttp.StreamReader, max_bytes: int) -> bytes | None:
    """The whole body, or None once it passes `max_bytes` (StreamReader.read(n) returns what is buffered,
    one chunk of a large body, so the body is read to its end here)."""
    chunks, size = [], 0
    async for chunk in stream.iter_any():
        size += len(chunk)
        if size > max_bytes:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _bad_gateway(source: str, reason: str) -> web.Response:
    return web.Response(status=502, text=f"metrics source {source} {reason}\n")
