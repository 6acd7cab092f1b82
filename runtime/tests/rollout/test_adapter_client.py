"""A LoRA job's rollout client: every request names the adapter version last published, every token
carries that version, and the TITO session server's turns go through it too (never around it to the
replicas, which would sample the base). Against a real HTTP server on 127.0.0.1 recording the bodies."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer
from lockstep.driver.engines import PoolClient
from lockstep.rollout.adapter import AdapterClient
from lockstep.rollout.session.engine import BackendEngine
from lockstep.rollout.session.local import turn_engine
from lockstep.serving import EngineClient, SamplingParams


async def _recorder(seen: list[dict[str, Any]]) -> TestServer:
    async def generate(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        seen.append(body)
        meta = {"id": "r", "finish_reason": {"type": "length", "length": 2}, "weight_version": "0",
                "weight_versions": [{"version": "0", "start": 0, "end": 2}],
                "output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, None]]}  # fmt: skip
        return web.json_response({"text": "", "output_ids": [7, 8], "meta_info": meta})

    app = web.Application()
    app.router.add_post("/generate", generate)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def test_requests_name_the_published_version_and_tokens_carry_it() -> None:
    seen: list[dict[str, Any]] = []
    servers = [await _recorder(seen), await _recorder(seen)]
    clients = [EngineClient(str(s.make_url("")), retries=1) for s in servers]
    try:
        adapter = AdapterClient(PoolClient(clients), "job-a")
        before = await adapter.generate([1, 2], SamplingParams(max_new_tokens=2))
        assert "lora_path" not in seen[-1]  # nothing published yet: the base (a fresh adapter) samples
        assert before.token_versions == [0, 0]
        adapter.version = 3
        got = await adapter.generate([1, 2], SamplingParams(max_new_tokens=2), lora_path="other-v9")
        assert seen[-1]["lora_path"] == "job-a-v3"  # its own adapter, whatever the caller passes
        assert got.token_versions == [3, 3] and got.weight_version == 3
        # the session server takes the adapter client as one backend (not the two replicas)
        engine = turn_engine(adapter)
        assert isinstance(engine, BackendEngine)
        turn = await engine.generate("s1", [1, 2, 3], SamplingParams(max_new_tokens=2), False)
        assert seen[-1]["lora_path"] == "job-a-v3" and turn.token_versions == [3, 3]
        assert not isinstance(turn_engine(PoolClient(clients)), BackendEngine)  # without LoRA: affinity
    finally:
        for c in clients:
            await c.aclose()
        for s in servers:
            await s.close()
