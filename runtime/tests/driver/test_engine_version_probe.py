"""The driver asks every engine for its weight version (EngineVersionProbe), real engines on loopback.

Why: the operator gates an engine's readiness on the version it holds, and the driver only knows the
engines' addresses (the pool's headless Service), not their pod names. Two real reference engines
listen on the same port of two loopback addresses, as two engine pods do behind one headless
Service; one is moved to version 3 through its real /update_weight_version endpoint; a third
address answers nothing.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
import torch
from lockstep.api.progress import PROGRESS_KEY, ProgressReport
from lockstep.progress import ConfigMapReporter, EngineVersionProbe, reporter_from_env


def _free_port() -> int:
    """A port free on 127.0.0.1 and 127.0.0.2 (both are bound below; the kernel hands it out once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Engines:
    """Reference engines served on (host, port) pairs by one private event loop thread."""

    def __init__(
        self, model_dir: Path, hosts: list[str], port: int, max_lora_rank: int | None = None
    ) -> None:
        from aiohttp import web
        from lockstep.engine import ReferenceEngine, create_app

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners: list[Any] = []
        for host in hosts:
            engine = ReferenceEngine.load(model_dir, device="cpu")
            if max_lora_rank is not None:
                engine.enable_lora(max_rank=max_lora_rank)
            runner = web.AppRunner(create_app(engine))

            async def start(r: Any = runner, h: str = host) -> None:
                await r.setup()
                await web.TCPSite(r, h, port).start()

            asyncio.run_coroutine_threadsafe(start(), self.loop).result(60)
            self.runners.append(runner)

    def close(self) -> None:
        for runner in self.runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    from lockstep.models.tiny import materialize_builtin

    model_dir = materialize_builtin("tiny", tmp_path_factory.mktemp("tiny"))
    port = _free_port()
    served = Engines(model_dir, ["127.0.0.1", "127.0.0.2"], port)
    r = httpx.post(f"http://127.0.0.2:{port}/update_weight_version", json={"new_version": "3"})
    assert r.status_code == 200 and r.json()["success"] is True
    yield port
    served.close()


def test_every_address_of_the_service_reports_its_version(engines: int) -> None:
    port = engines
    probe = EngineVersionProbe(
        "rollout-engines",
        port,
        timeout_s=1.0,
        resolve=lambda host, p: ["127.0.0.1", "127.0.0.2", "127.0.0.3"],
    )
    # 127.0.0.3 answers nothing: left out (the operator then counts that engine as behind).
    assert probe.versions() == {f"127.0.0.1:{port}": 0, f"127.0.0.2:{port}": 3}


def test_a_real_dns_name_and_a_name_that_does_not_resolve(engines: int) -> None:
    port = engines
    versions = EngineVersionProbe("localhost", port, timeout_s=1.0).versions()
    assert versions is not None
    assert versions.get(f"127.0.0.1:{port}") == 0  # ::1, if localhost has it, serves nothing here
    assert EngineVersionProbe("no-such-engines.invalid", port).versions() is None  # unknown, not "none"


class _ApiServer(BaseHTTPRequestHandler):
    """A loopback stand-in for the API server's ConfigMap PATCH (records the progress documents)."""

    documents: ClassVar[list[dict[str, Any]]] = []

    def do_PATCH(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.documents.append(json.loads(body["data"][PROGRESS_KEY]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


def test_each_report_with_a_version_carries_every_engines_version(engines: int, tmp_path: Path) -> None:
    port = engines
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ApiServer)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        (tmp_path / "token").write_text("t")
        probe = EngineVersionProbe("svc", port, resolve=lambda host, p: ["127.0.0.1", "127.0.0.2"])
        rep = ConfigMapReporter(
            f"http://127.0.0.1:{server.server_address[1]}", "ns", "j-progress",
            token_path=tmp_path / "token", ca_path=None, probe=probe,
        )  # fmt: skip
        assert rep.report(ProgressReport(step=3, weight_version=3))
        assert rep.report(ProgressReport(error="boom"))  # no version published: nothing to compare
    finally:
        server.shutdown()
        server.server_close()
    first, second = _ApiServer.documents
    assert first["engineAddressVersions"] == {f"127.0.0.1:{port}": 0, f"127.0.0.2:{port}": 3}
    assert "engineAddressVersions" not in second


def test_reporter_from_env_probes_the_engines_service(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("t")
    env = {"LOCKSTEP_PROGRESS_CONFIGMAP": "j-progress", "KUBERNETES_SERVICE_HOST": "10.96.0.1",
           "LOCKSTEP_ENGINES_SERVICE": "j-rollout-engines"}  # fmt: skip
    rep = reporter_from_env(env, sa_dir=tmp_path)
    assert isinstance(rep, ConfigMapReporter) and rep.probe is not None
    assert (rep.probe.host, rep.probe.port) == ("j-rollout-engines", 30000)
    without = reporter_from_env(
        {k: v for k, v in env.items() if k != "LOCKSTEP_ENGINES_SERVICE"}, sa_dir=tmp_path
    )
    assert isinstance(without, ConfigMapReporter) and without.probe is None


def test_a_lora_jobs_probe_reports_the_adapter_version_each_engine_holds(tmp_path: Path) -> None:
    """A LoRA job's engines: 127.0.0.1 holds the job's versions 4 and 5 (and another job's 9),
    127.0.0.2 joined since and holds only the other job's: left out, the operator gates it."""
    from lockstep.models.adapter_dir import save_adapter
    from lockstep.models.tiny import materialize_builtin
    from lockstep.serving.lora import adapter_config

    model_dir = materialize_builtin("tiny", tmp_path / "tiny")
    port = _free_port()
    served = Engines(model_dir, ["127.0.0.1", "127.0.0.2"], port, max_lora_rank=4)
    try:
        a = "base_model.model.model.layers.0.self_attn.q_proj"
        tensors = {f"{a}.lora_A.weight": torch.zeros(4, 64), f"{a}.lora_B.weight": torch.zeros(64, 4)}
        config = adapter_config({n: t.shape for n, t in tensors.items()}, alpha=8)
        save_adapter(tmp_path / "ad", tensors, config)
        for host, names in (("127.0.0.1", ["job-v4", "job-v5", "other-v9"]), ("127.0.0.2", ["other-v9"])):
            for name in names:
                r = httpx.post(
                    f"http://{host}:{port}/load_lora_adapter",
                    json={"lora_name": name, "lora_path": str(tmp_path / "ad")},
                    timeout=30,
                )
                assert r.status_code == 200, r.text
        hosts = lambda host, p: ["127.0.0.1", "127.0.0.2"]  # noqa: E731
        assert EngineVersionProbe("svc", port, resolve=hosts, adapter="job").versions() == {
            f"127.0.0.1:{port}": 5
        }
        assert EngineVersionProbe("svc", port, resolve=hosts, adapter="other").versions() == {
            f"127.0.0.1:{port}": 9,
            f"127.0.0.2:{port}": 9,
        }
        # without the adapter: the engines' base weight_version, which adapters never move
        assert EngineVersionProbe("svc", port, resolve=hosts).versions() == {
            f"127.0.0.1:{port}": 0,
            f"127.0.0.2:{port}": 0,
        }
    finally:
        served.close()
