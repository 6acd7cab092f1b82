"""EngineClient's behaviour against SGLang-shaped replies: per-token versions, errors, retries, payloads.

What the client sends is checked against the pinned SGLang's own source in runtime/tests/sglang/
(routes, request structs, the /generate contract gate). Here, replies are SGLang-shaped bodies served
by a real aiohttp server on 127.0.0.1: the version spans SGLang sends, the honest derivation for a
server that sends none, error and retry handling.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import socket
from collections.abc import AsyncIterator
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
    UnsafePayload,
    dumps_named_tensors,
    loads_named_tensors,
    result_from_reply,
)

# A reply without meta_info.weight_versions (a server older than the pin): the client derives versions.
SPANLESS_GENERATE_REPLY = {
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
        self.fail_updates = False

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.seen.append(
            {"method": request.method, "path": request.path, "body": json.loads(raw) if raw else None}
        )
        path = request.path
        if path == "/generate":
            return web.json_response(SPANLESS_GENERATE_REPLY)
        if path in ("/health", "/health_generate", "/abort_request", "/flush_cache"):
            return web.Response(status=200)
        if path in ("/pause_generation", "/continue_generation"):
            return web.json_response({"message": "Generation paused successfully.", "status": "ok"})
        if path == "/model_info":
            return web.json_response(
                {"model_path": "/m", "is_generation": True, "weight_version": self.version}
            )
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


async def test_versions_are_derived_honestly_without_spans(fake: tuple[FakeSGLang, EngineClient]) -> None:
    _server, client = fake
    first = await client.generate([5, 6, 7])
    assert first.token_versions == [None, None]  # nothing known before submit
    assert first.output_logprobs == [-0.5, -0.25] and first.cached_tokens == 2 and first.matched_stop == 1
    second = await client.generate([5, 6, 7])
    assert second.token_versions == [4, 4]  # saw 4 before submit and 4 at the end
    await client.update_weight_version(7)  # client now believes 7; the reply says 4
    third = await client.generate([5, 6, 7])
    assert third.token_versions == [None, None]


async def test_weight_version_comes_from_model_info(fake: tuple[FakeSGLang, EngineClient]) -> None:
    server, client = fake
    assert await client.get_weight_version() == 4
    assert [s["path"] for s in server.seen] == ["/model_info"]


async def test_failed_update_raises_with_the_message(fake: tuple[FakeSGLang, EngineClient]) -> None:
    server, client = fake
    server.fail_updates = True
    with pytest.raises(EngineError, match="boom") as err:
        await client.update_weights_from_disk("/x", weight_version=1)
    assert err.value.status == 400


def test_sglang_version_spans_give_per_token_versions_and_length_checks() -> None:
    body = json.loads(json.dumps(SPANLESS_GENERATE_REPLY))
    body["meta_info"]["weight_versions"] = [
        {"version": "3", "start": 0, "end": 1},
        {"version": "4", "start": 1, "end": 2},
    ]
    res = result_from_reply(GenerateReply.model_validate(body), submit_version=None)
    assert res.token_versions == [3, 4]  # retracted after one token, resumed on version 4
    body["meta_info"]["weight_versions"] = [{"version": "3", "start": 0, "end": 1}]
    with pytest.raises(ValueError, match="spans over 1 tokens for 2 tokens"):
        result_from_reply(GenerateReply.model_validate(body), submit_version=None)
    body["meta_info"]["weight_versions"] = [{"version": "x", "start": 0, "end": 2}]
    assert result_from_reply(GenerateReply.model_validate(body), submit_version=None).token_versions == [
        None,
        None,
    ]
    del body["meta_info"]["weight_versions"]
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
