"""`lockstep metrics-relay` over real loopback HTTP: a source's /metrics text comes back unchanged, a
down or oversized source is a 502 naming it, and nothing but GET /metrics is served (the relay is the
only thing an SGLang engine pod serves on its any-source `metrics` port, docs/monitoring.md)."""

from __future__ import annotations

import asyncio
import socket

import httpx
from aiohttp import web
from aiohttp.test_utils import TestServer
from lockstep.observability.metrics_relay import relay_app

TEXT = (
    "# HELP sglang:num_running_reqs The number of running requests.\n"
    "# TYPE sglang:num_running_reqs gauge\n"
    'sglang:num_running_reqs{model_name="m"} 3.0\n'
)
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


async def _source(body: str = TEXT) -> TestServer:
    """A stand-in for SGLang's /metrics (prometheus_client's content negotiation: OpenMetrics on ask)."""

    async def metrics(request: web.Request) -> web.Response:
        if "openmetrics" in request.headers.get("Accept", ""):
            return web.Response(text=body + "# EOF\n", headers={"Content-Type": OPENMETRICS})
        return web.Response(text=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def generate(_request: web.Request) -> web.Response:
        return web.Response(text="generated")

    async def hang(_request: web.Request) -> web.Response:
        await asyncio.Event().wait()  # never answers
        raise AssertionError("unreachable")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/hang", hang)
    app.router.add_post("/generate", generate)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def _relay(source: str, **kwargs: float) -> TestServer:
    server = TestServer(relay_app(source, **kwargs), host="127.0.0.1")  # type: ignore[arg-type]
    await server.start_server()
    return server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_sources_text_comes_back_with_its_content_type() -> None:
    source = await _source()
    relay = await _relay(f"http://127.0.0.1:{source.port}/metrics")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{relay.port}") as client:
            r = await client.get("/metrics")
            assert r.status_code == 200 and r.text == TEXT
            assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
            om = await client.get("/metrics", headers={"Accept": OPENMETRICS})  # Prometheus asks for it
            assert om.status_code == 200 and om.text == TEXT + "# EOF\n"
            assert om.headers["content-type"] == OPENMETRICS
    finally:
        await relay.close()
        await source.close()


async def test_only_get_metrics_is_served() -> None:
    source = await _source()
    relay = await _relay(f"http://127.0.0.1:{source.port}/metrics")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{relay.port}") as client:
            assert (await client.post("/metrics", content=b"x")).status_code == 405
            assert (await client.post("/generate", json={"text": "hi"})).status_code == 404
            assert (await client.get("/generate")).status_code == 404
            assert (await client.get("/")).status_code == 404
            assert (await client.get("/metrics/../generate")).status_code == 404
    finally:
        await relay.close()
        await source.close()


async def test_a_down_source_is_a_502_naming_it() -> None:
    url = f"http://127.0.0.1:{_free_port()}/metrics"  # nothing listens there
    relay = await _relay(url, timeout_s=5.0)
    try:
        async with httpx.AsyncClient() as client:
            r = await client.get(f"http://127.0.0.1:{relay.port}/metrics")
        assert r.status_code == 502
        assert r.text.startswith(f"metrics source {url} unreachable") and r.text.count("\n") == 1, r.text
    finally:
        await relay.close()


async def test_a_source_that_never_answers_is_a_502_after_the_timeout() -> None:
    source = await _source()
    url = f"http://127.0.0.1:{source.port}/hang"
    relay = await _relay(url, timeout_s=0.2)
    try:
        async with httpx.AsyncClient() as client:
            r = await client.get(f"http://127.0.0.1:{relay.port}/metrics")
        assert r.status_code == 502 and r.text == f"metrics source {url} did not answer within 0.2 s\n"
    finally:
        await relay.close()
        await source.close()


async def test_a_source_error_status_is_a_502() -> None:
    source = await _source()
    url = f"http://127.0.0.1:{source.port}/nothing"
    relay = await _relay(url)
    try:
        async with httpx.AsyncClient() as client:
            r = await client.get(f"http://127.0.0.1:{relay.port}/metrics")
        assert r.status_code == 502 and r.text == f"metrics source {url} answered HTTP 404\n"
    finally:
        await relay.close()
        await source.close()


async def test_a_body_over_the_bound_is_a_502_and_one_at_it_passes() -> None:
    source = await _source()
    url = f"http://127.0.0.1:{source.port}/metrics"
    exact, under = await _relay(url, max_bytes=len(TEXT)), await _relay(url, max_bytes=len(TEXT) - 1)
    try:
        async with httpx.AsyncClient() as client:
            ok = await client.get(f"http://127.0.0.1:{exact.port}/metrics")
            over = await client.get(f"http://127.0.0.1:{under.port}/metrics")
        assert ok.status_code == 200 and ok.text == TEXT
        assert over.status_code == 502
        assert over.text == f"metrics source {url} sent more than {len(TEXT) - 1} bytes\n"
    finally:
        await exact.close()
        await under.close()
        await source.close()


async def test_a_body_of_many_chunks_comes_back_whole() -> None:
    """SGLang's histograms make a body of many TCP chunks: the relay reads to the end, not one chunk."""
    big = "".join(f'sglang:e2e_request_latency_seconds_bucket{{le="{i}"}} {i}.0\n' for i in range(40_000))
    source = await _source(big)
    relay = await _relay(f"http://127.0.0.1:{source.port}/metrics")
    try:
        async with httpx.AsyncClient() as client:
            r = await client.get(f"http://127.0.0.1:{relay.port}/metrics")
        assert r.status_code == 200 and len(r.text) == len(big) and r.text == big
    finally:
        await relay.close()
        await source.close()
