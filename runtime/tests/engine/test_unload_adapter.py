"""`lockstep unload-adapter NAME --engine URL`: what the operator runs when a job on a shared pool is
deleted or ends (docs/lora.md, "Cleanup"), against the reference engine over loopback HTTP.

What must hold: every loaded version of NAME (`NAME-v<n>`) leaves the engine through stock SGLang's
POST /unload_lora_adapter and GET /v1/models no longer lists them; other adapters (another job's, and
a name that only starts like NAME) stay loaded; the route is authenticated like the engine's other
mutating routes: without the pool's API key nothing is unloaded and the command fails naming the
engine (the operator then runs it again).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from lockstep.api.auth import API_KEY_ENV
from lockstep.cli import main
from lockstep.driver.engines import EngineServer, start_reference_engine
from lockstep.serving import EngineClient, EngineError
from lockstep.serving.tensor_codec import dumps_tensors_by_value
from lockstep.train.fsdp import FSDPBackend, FSDPConfig
from lockstep.train.fsdp.lora import AdapterConfig

KEY = "pool-key"
NAMES = ["gone-v1", "gone-v2", "gone-v-x-v3", "kept-v1", "gone"]


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Iterator[EngineServer]:
    b = FSDPBackend(
        FSDPConfig(model_path=tiny_dir, device="cpu", seed=1, lora=AdapterConfig(rank=4, alpha=8, name="a"))
    )
    tensors = {n: t.clone() for n, t in b.export_weights()}
    config = b.adapter_config()
    b.close()
    server = start_reference_engine(tiny_dir, max_lora_rank=8, api_key=KEY)

    async def load() -> None:
        async with EngineClient(server.url, retries=1, api_key=KEY) as c:
            for name in NAMES:
                await c.load_lora_adapter_from_tensors(name, config, dumps_tensors_by_value(tensors.items()))

    asyncio.run(load())
    yield server
    server.stop()


def _listed(url: str) -> list[str]:
    async def go() -> list[str]:
        async with EngineClient(url, retries=1, api_key=KEY) as c:
            return sorted((await c.list_models()).adapters())

    return asyncio.run(go())


def test_without_the_key_nothing_is_unloaded_and_the_command_fails_naming_the_engine(
    engine: EngineServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def unauthorized() -> None:
        async with EngineClient(engine.url, retries=1, api_key="wrong") as c:
            await c.unload_lora_adapter("gone-v1")

    with pytest.raises(EngineError) as err:
        asyncio.run(unauthorized())
    assert err.value.status == 401
    monkeypatch.setenv(API_KEY_ENV, "wrong")
    assert main(["unload-adapter", "gone", "--engine", engine.url]) == 2
    assert f"engine {engine.url}" in capsys.readouterr().err
    assert _listed(engine.url) == sorted(NAMES)


def test_every_version_of_the_adapter_is_unloaded_and_no_other(
    engine: EngineServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert main(["unload-adapter", "gone", "--engine", engine.url]) == 0
    assert "unloaded gone, gone-v1, gone-v2" in capsys.readouterr().out
    # `gone-v-x-v3` is a version of adapter `gone-v-x`, another job's; `kept-v1` another job's
    assert _listed(engine.url) == ["gone-v-x-v3", "kept-v1"]
    assert main(["unload-adapter", "gone", "--engine", engine.url]) == 0  # again: nothing left, no error
    assert "unloaded nothing" in capsys.readouterr().out
