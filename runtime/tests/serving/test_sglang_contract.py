"""Contract tests of the SGLang HTTP API as EngineClient speaks it.

The requests the client sends are pinned by a golden file (golden/requests.json, reviewed against
SGLang's io_struct.py and http_server.py: field names, defaults, routes, methods). Replies are
SGLang-shaped bodies served by a real aiohttp server on 127.0.0.1 that records what it receives;
stock SGLang carries no per-token versions, so the client's honest derivation is checked here too.
Set LOCKSTEP_UPDATE_GOLDEN=1 to rewrite the golden file (then review the diff).
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer
from lockstep.serving import (
    EngineClient,
    EngineError,
    EngineUnreachable,
    GenerateReply,
    SamplingParams,
    UnsafePayload,
    dumps_named_tensors,
    loads_named_tensors,
    result_from_reply,
)

GOLDEN = Path(__file__).parent / "golden" / "requests.json"

STOCK_GENERATE_REPLY = {
    "text": "ok",
    "output_ids": [30, 1],
    "meta_info": {
        "id": "r1",
        "finish_reason": {"type": "stop", "matched": 1},
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "cached_tokens": 2,
        "weight_version": "4",
        "output_token_logprobs": [[-0.5, 30, None], [-0.25, 1, None]],
        "e2e_latency": 0.01,
        "spec_verify_ct": 0,
    },
}


class FakeSGLang:
    """Records every request and answers with SGLang-shaped bodies (what SGLang's handlers return)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.version = "4"
        self.model_info_404 = False
        self.fail_updates = False

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.seen.append(
            {"method": request.method, "path": request.path, "body": json.loads(raw) if raw else None}
        )
        path = request.path
        if path == "/generate":
            return web.json_response(STOCK_GENERATE_REPLY)
        if path in ("/health", "/health_generate", "/abort_request", "/flush_cache"):
            return web.Response(status=200)
        if path in ("/pause_generation", "/continue_generation"):
            return web.json_response({"message": "Generation paused successfully.", "status": "ok"})
        if path == "/model_info":
            if self.model_info_404:
                return web.Response(status=404)
            return web.json_response(
                {"model_path": "/m", "is_generation": True, "weight_version": self.version}
            )
        if path == "/get_weight_version":
            return web.json_response({"weight_version": self.version})
        if path == "/update_weight_version":
            return web.json_response({"success": True, "message": "ok", "new_version": "7"})
        if self.fail_updates:
            return web.json_response({"success": False, "message": "boom"}, status=400)
        return web.json_response({"success": True, "message": "ok"})


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeSGLang, EngineClient]]:
    f = FakeSGLang()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", f.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    client = EngineClient(str(server.make_url("")), retries=1)
    try:
        yield f, client
    finally:
        await client.aclose()
        await server.close()


async def _every_call(c: EngineClient) -> None:
    sp = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=[1])
    await c.generate([5, 6, 7], sp, rid="r1")
    await c.generate([5, 6, 7], SamplingParams(max_new_tokens=0), logprob_start_len=0, rid="r2")
    await c.generate([5, 6, 7], SamplingParams(max_new_tokens=1), rid="r3", routed_dp_rank=1)
    await c.abort("r1")
    await c.abort()
    await c.health_generate()
    await c.flush_cache()
    await c.pause_generation("retract")
    await c.continue_generation()
    await c.update_weights_from_disk("/ckpt/step_3", weight_version=3)
    await c.init_weights_update_group("10.0.0.1", 29500, rank_offset=1, world_size=3, backend="nccl")
    await c.update_weights_from_distributed(
        ["model.norm.weight"], ["bfloat16"], [[64]], group_name="weight_update_group", weight_version=4
    )
    await c.destroy_weights_update_group()
    await c.update_weights_from_tensor(["AAAA"], weight_version=5)
    await c.update_weight_version(7)
    await c.model_info()


async def test_requests_match_golden(fake: tuple[FakeSGLang, EngineClient]) -> None:
    server, client = fake
    await _every_call(client)
    if os.environ.get("LOCKSTEP_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(server.seen, indent=1) + "\n")
    assert server.seen == json.loads(GOLDEN.read_text())


async def test_stock_sglang_versions_are_derived_honestly(fake: tuple[FakeSGLang, EngineClient]) -> None:
    _server, client = fake
    first = await client.generate([5, 6, 7])
    assert first.token_versions == [None, None]  # nothing known before submit
    assert first.output_logprobs == [-0.5, -0.25] and first.cached_tokens == 2 and first.matched_stop == 1
    second = await client.generate([5, 6, 7])
    assert second.token_versions == [4, 4]  # saw 4 before submit and 4 at the end
    await client.update_weight_version(7)  # client now believes 7; the reply says 4
    third = await client.generate([5, 6, 7])
    assert third.token_versions == [None, None]


async def test_weight_version_falls_back_to_old_route(fake: tuple[FakeSGLang, EngineClient]) -> None:
    server, client = fake
    server.model_info_404 = True
    assert await client.get_weight_version() == 4
    assert [s["path"] for s in server.seen] == ["/model_info", "/get_weight_version"]


async def test_failed_update_raises_with_the_message(fake: tuple[FakeSGLang, EngineClient]) -> None:
    server, client = fake
    server.fail_updates = True
    with pytest.raises(EngineError, match="boom") as err:
        await client.update_weights_from_disk("/x", weight_version=1)
    assert err.value.status == 400


def test_extension_versions_and_length_checks() -> None:
    body = json.loads(json.dumps(STOCK_GENERATE_REPLY))
    body["meta_info"]["output_token_weight_versions"] = [3, 4]
    res = result_from_reply(GenerateReply.model_validate(body), submit_version=None)
    assert res.token_versions == [3, 4]
    body["meta_info"]["output_token_logprobs"] = [[-0.5, 30, None]]
    with pytest.raises(ValueError, match="1 output_token_logprobs for 2 output_ids"):
        result_from_reply(GenerateReply.model_validate(body), submit_version=None)


async def test_unreachable_engine_is_retried_then_named() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    waits: list[float] = []

    async def fake_sleep(d: float) -> None:
        waits.append(d)

    client = EngineClient(
        f"http://127.0.0.1:{port}", retries=4, backoff_s=0.5, max_backoff_s=1.5, sleep=fake_sleep
    )
    with pytest.raises(EngineUnreachable, match=f"127.0.0.1:{port}/generate unreachable after 4 attempts"):
        await client.generate([1, 2])
    assert waits == [0.5, 1.0, 1.5]
    assert not await client.health()
    await client.aclose()


def test_tensor_payload_round_trip_and_refusal() -> None:
    named = [("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.ones(3, dtype=torch.bfloat16))]
    back = loads_named_tensors(dumps_named_tensors(named))
    assert [n for n, _ in back] == ["a", "b"] and all(
        torch.equal(x, y) for (_, x), (_, y) in zip(named, back, strict=False)
    )

    class Evil:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, ("true",))

    with pytest.raises(UnsafePayload, match="not allowed"):
        loads_named_tensors(base64.b64encode(pickle.dumps([("x", Evil())])).decode())
    with pytest.raises(UnsafePayload, match="list of \\(name, tensor\\)"):
        loads_named_tensors(base64.b64encode(pickle.dumps([1, 2])).decode())
