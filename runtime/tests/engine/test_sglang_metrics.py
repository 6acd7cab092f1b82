"""The reference engine's GET /metrics serves SGLang's own series: same names and types as the
collectors of the pinned SGLang wheel (sglang/srt/observability/metrics_collector.py, read from the
installed wheel, the oracle of the contract), with values that follow a real generation over HTTP.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import httpx
from aiohttp.test_utils import TestServer
from lockstep.engine import ReferenceEngine, create_app
from lockstep.engine.metrics import engine_registry, sglang_registry
from lockstep.observability.metrics import serve_registry
from lockstep.serving.payloads import SamplingParams
from prometheus_client.parser import text_string_to_metric_families

_KINDS = {"Gauge": "gauge", "Counter": "counter", "Histogram": "histogram", "Summary": "summary"}


def _sglang_series() -> dict[str, str]:
    """Every `sglang:*` metric SGLang's collectors define: family name (a Counter's without
    `_total`, as prometheus_client exposes it) -> type."""
    spec = importlib.util.find_spec("sglang.srt.observability.metrics_collector")
    assert spec is not None and spec.origin, "the SGLang wheel is not installed (make setup installs it)"
    tree = ast.parse(Path(spec.origin).read_text())
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _KINDS:
            for kw in node.keywords:
                if (
                    kw.arg == "name"
                    and isinstance(kw.value, ast.Constant)
                    and str(kw.value.value).startswith("sglang:")
                ):
                    name = str(kw.value.value)
                    kind = _KINDS[node.func.id]
                    found[name.removesuffix("_total") if kind == "counter" else name] = kind
    return found


def test_the_collector_is_found_in_the_wheel() -> None:
    series = _sglang_series()
    # the series the dashboard shows, defined where the test looks (a moved collector fails here)
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                 "sglang:generation_tokens", "sglang:time_to_first_token_seconds"):  # fmt: skip
        assert name in series, f"{name} not in SGLang's metrics_collector.py: the wheel moved it"


def test_reference_engine_series_have_sglangs_names_and_types(tiny_dir: Path) -> None:
    engine = ReferenceEngine.load(tiny_dir, max_running_requests=4, context_length=128, seed=0)
    sglang = _sglang_series()
    ours = {f.name: f.type for f in sglang_registry(engine).collect()}
    assert ours, "the reference engine serves no sglang:* series"
    for name, kind in ours.items():
        assert name in sglang, f"{name}: SGLang defines no such series"
        assert kind == sglang[name], f"{name}: {kind} here, {sglang[name]} in SGLang"


async def test_get_metrics_follows_a_generation(tiny_dir: Path) -> None:
    engine = ReferenceEngine.load(tiny_dir, max_running_requests=8, context_length=256, seed=0)
    server = TestServer(create_app(engine, api_key="k"), host="127.0.0.1")
    await server.start_server()
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"

        async def scrape() -> dict[str, float]:
            async with (
                httpx.AsyncClient() as client
            ):  # no key: Prometheus scrapes unauthenticated, as SGLang allows
                r = await client.get(url)
            assert r.status_code == 200, r.text
            return {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples}

        before = await scrape()
        assert before["sglang:generation_tokens_total"] == 0.0
        assert before["sglang:num_running_reqs"] == 0.0
        seq = engine.new_sequence(
            [1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        )
        await engine.submit(seq)
        after = await scrape()
        assert after["sglang:generation_tokens_total"] == 4.0
        assert after["sglang:prompt_tokens_total"] == 3.0
        assert after["sglang:num_requests_total"] == 1.0
        assert after["sglang:num_queue_reqs"] == 0.0
    finally:
        await server.close()


async def test_the_metrics_port_serves_the_sglang_series_too(tiny_dir: Path) -> None:
    """The pod's `metrics` port (engine_registry, what `lockstep engine` serves on $LOCKSTEP_METRICS_PORT)
    carries the same sglang:* series as the HTTP port's /metrics: the lockstep-engine scrape job, the
    only one a NetworkPolicy lets Prometheus reach, collects them (docs/monitoring.md)."""
    engine = ReferenceEngine.load(tiny_dir, max_running_requests=8, context_length=256, seed=0)
    server = TestServer(create_app(engine), host="127.0.0.1")  # its start-up runs the engine's loop
    await server.start_server()
    try:
        port = serve_registry(engine_registry(engine, lambda: True), 0, "127.0.0.1")
        params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        await engine.submit(engine.new_sequence([1, 2, 3], params))
        async with httpx.AsyncClient() as client:
            r = await client.get(f"http://127.0.0.1:{port}/metrics")
    finally:
        await server.close()
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    served = {name for name in families if name.startswith("sglang:")}
    assert served == {f.name for f in sglang_registry(engine).collect()}
    samples = {s.name: s.value for f in families.values() for s in f.samples}
    assert samples["sglang:generation_tokens_total"] == 4.0 and samples["sglang:prompt_tokens_total"] == 3.0
    assert samples["lockstep_engine_generated_tokens_total"] == 4.0  # next to the engine's own series
