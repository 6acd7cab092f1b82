"""The engine's Prometheus series, scraped over real HTTP from a served tiny engine (what a PodMonitor reads).

A generation moves the token counters; a weight-group join in progress (what /health answers 503 to)
turns `lockstep_engine_ready` to 0, and the series parse with prometheus_client's own text parser.
"""

from __future__ import annotations

from pathlib import Path

import httpx
from aiohttp.test_utils import TestServer
from lockstep.engine import ReferenceEngine, create_app
from lockstep.engine.metrics import engine_registry
from lockstep.engine.server import _JOIN_KEY, serving
from lockstep.observability.metrics import serve_registry
from lockstep.serving.payloads import SamplingParams
from prometheus_client.parser import text_string_to_metric_families


def _scrape(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


async def test_engine_series_follow_generation_and_readiness(tiny_dir: Path) -> None:
    engine = ReferenceEngine.load(tiny_dir, max_running_requests=8, context_length=256, seed=0)
    app = create_app(engine)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        port = serve_registry(engine_registry(engine, lambda: serving(app)), 0, "127.0.0.1")
        before = _scrape(port)
        assert before["lockstep_engine_ready"] == 1.0
        assert before["lockstep_engine_generated_tokens_total"] == 0.0
        seq = engine.new_sequence(
            [1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        )
        await engine.submit(seq)
        after = _scrape(port)
        assert after["lockstep_engine_generated_tokens_total"] == 4.0
        assert after["lockstep_engine_prompt_tokens_total"] == 3.0
        assert after["lockstep_engine_weight_version"] == float(engine.weight_version)
        app[_JOIN_KEY]["join"] = object()  # a join in progress: /health says 503, so does the series
        assert _scrape(port)["lockstep_engine_ready"] == 0.0
        app[_JOIN_KEY]["join"] = None
    finally:
        await server.close()
