"""The engine pod's metrics relay in front of SGLang's own /metrics server, scraped by a real Prometheus.

Why: an SGLang engine pod's `sglang:*` series reach Prometheus only through the `lockstep
metrics-relay` sidecar (docs/monitoring.md). SGLang cannot run here, so its /metrics is served here by
SGLang's own code from the pinned wheel: `set_prometheus_multiproc_dir` and `add_prometheus_middleware`
(prometheus_client's ASGI app over a multiprocess directory, mounted as SGLang mounts it), in front of
series that another process wrote with SGLang's names and multiprocess modes (read from the wheel's
collector source), as SGLang's scheduler and tokenizer processes do. The relay runs as the operator
renders it (resources.metrics_relay.relay_command, the pod IP and ports replaced by loopback ones).
A real Prometheus scrapes the relay (it asks for OpenMetrics and gzip) and must store every series the
dashboard's SGLang row queries, with the values written.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from lockstep_operator.resources.common import ENGINE_PORT, METRICS_PORT, POD_IP_ENV
from lockstep_operator.resources.metrics_relay import relay_command

from e2e.controlplane.ports import free_ports
from e2e.controlplane.promserver import Prometheus, find_bin

VENV_BIN = Path(sys.executable).parent
GAUGES = {"sglang:num_running_reqs": 3.0, "sglang:num_queue_reqs": 2.0, "sglang:token_usage": 0.25}
COUNTERS = {"sglang:prompt_tokens": 120.0, "sglang:generation_tokens": 48.0, "sglang:num_requests": 6.0}
HISTOGRAM = "sglang:time_to_first_token_seconds"
LABELS = {"model_name": "tiny"}


def _gauge_modes() -> dict[str, str]:
    """multiprocess_mode of each of GAUGES in SGLang's collectors (the wheel's source, the oracle)."""
    spec = importlib.util.find_spec("sglang.srt.observability.metrics_collector")
    assert spec is not None and spec.origin, "the SGLang wheel is not installed (make setup installs it)"
    modes: dict[str, str] = {}
    for node in ast.walk(ast.parse(Path(spec.origin).read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Gauge":
            kw = {k.arg: k.value for k in node.keywords}
            name, mode = kw.get("name"), kw.get("multiprocess_mode")
            if isinstance(name, ast.Constant) and name.value in GAUGES:
                modes[str(name.value)] = str(mode.value) if isinstance(mode, ast.Constant) else "all"
    missing = set(GAUGES) - set(modes)
    assert not missing, (
        f"{sorted(missing)} not defined as Gauges in SGLang's collectors: the wheel moved them"
    )
    return modes


WRITER = """
import json, sys
from prometheus_client import Counter, Gauge, Histogram
labels, gauges, modes, counters, histogram = json.loads(sys.argv[1])
for name, value in gauges.items():
    Gauge(name, name, labelnames=list(labels), multiprocess_mode=modes[name]).labels(**labels).set(value)
for name, value in counters.items():
    Counter(name, name, labelnames=list(labels)).labels(**labels).inc(value)
h = Histogram(histogram, histogram, labelnames=list(labels), buckets=[0.1, 0.5, 1.0, 5.0])
for v in (0.05, 0.3, 0.3, 2.0):
    h.labels(**labels).observe(v)
"""
"""A process writing the series into the multiprocess directory, as SGLang's scheduler does."""

SERVER = """
import sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from sglang.srt.utils.common import add_prometheus_middleware, set_prometheus_multiproc_dir
set_prometheus_multiproc_dir()  # keeps $PROMETHEUS_MULTIPROC_DIR, as SGLang's launch does when it is set
async def generate(request):
    return JSONResponse({"text": "never reachable through the relay"})
app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])  # SGLang's app is FastAPI's Starlette
add_prometheus_middleware(app)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""
"""SGLang's HTTP server as far as /metrics goes: its own middleware from the pinned wheel."""


def _wait_http(
    url: str, proc: subprocess.Popen[bytes], log: Path, what: str, timeout_s: float = 120.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"{what} exited {proc.returncode}: {log.read_text(errors='replace')[-2000:]}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{what} did not answer {url} in {timeout_s:.0f} s")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def _relay_argv(source_port: int, relay_port: int) -> list[str]:
    """The operator's relay command with the pod's IP and ports replaced by loopback ones."""
    argv = [a.replace(f"$({POD_IP_ENV})", "127.0.0.1") for a in relay_command()]
    argv = [a.replace(f":{ENGINE_PORT}/", f":{source_port}/") for a in argv]
    assert argv[argv.index("--port") + 1] == str(METRICS_PORT)
    argv[argv.index("--port") + 1] = str(relay_port)
    assert argv[0] == "lockstep" and argv[argv.index("--source") + 1].endswith(f":{source_port}/metrics")
    return [str(VENV_BIN / "lockstep"), *argv[1:]]


def test_prometheus_stores_sglangs_own_metrics_through_the_relay(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    find_bin()  # the pinned Prometheus (built by make controlplane)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")}
    (tmp_path / "prom").mkdir()
    spec = json.dumps([LABELS, GAUGES, _gauge_modes(), COUNTERS, HISTOGRAM])
    subprocess.run([sys.executable, "-c", WRITER, spec], env=env, check=True, timeout=60)
    source_port, relay_port = free_ports(2)
    sglang_log, relay_log = tmp_path / "sglang.log", tmp_path / "relay.log"
    with sglang_log.open("wb") as out:
        sglang = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(SERVER), str(source_port)],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    processes.append(sglang)
    _wait_http(f"http://127.0.0.1:{source_port}/metrics", sglang, sglang_log, "SGLang's metrics server")
    with relay_log.open("wb") as out:
        relay = subprocess.Popen(_relay_argv(source_port, relay_port), stdout=out, stderr=subprocess.STDOUT)
    processes.append(relay)
    relay_url = f"http://127.0.0.1:{relay_port}/metrics"
    _wait_http(relay_url, relay, relay_log, "the metrics relay")

    # what Prometheus 3 asks for: OpenMetrics first, gzip; the relay keeps SGLang's negotiated format
    ask = urllib.request.Request(relay_url, headers={"Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"})  # fmt: skip
    with urllib.request.urlopen(ask, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("application/openmetrics-text"), r.headers["Content-Type"]
        assert r.read().decode().rstrip().endswith("# EOF")
    refused = urllib.request.Request(relay_url.replace("/metrics", "/generate"), method="POST", data=b"{}")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(refused, timeout=10)
    assert err.value.code in (404, 405)

    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [{"job_name": "sglang", "static_configs": [{"targets": [f"127.0.0.1:{relay_port}"]}]}],
    }  # fmt: skip
    with Prometheus(config) as prom:
        want = {**GAUGES, **{f"{n}_total": v for n, v in COUNTERS.items()}, f"{HISTOGRAM}_count": 4.0}
        deadline, got = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            got = {n: prom.query(f'{n}{{model_name="tiny"}}') for n in want}
            if all(got.values()):
                break
            time.sleep(1)
        health = [(t["health"], t["lastError"]) for t in prom.targets()]
        for name, value in want.items():
            assert got[name], f"{name} never reached Prometheus through the relay; target {health}"
            assert float(got[name][0]["value"][1]) == value, (name, got[name])
        le = prom.query(f'{HISTOGRAM}_bucket{{le="0.5"}}')
        assert le and float(le[0]["value"][1]) == 3.0, le
