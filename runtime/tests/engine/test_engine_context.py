"""The runtime asks only for what fits in the engine's context (lockstep.serving.context_fit).

The engine refuses requests beyond its context as stock SGLang does (runtime/tests/sglang/
test_context_contract.py checks the 400 and the flag against the pinned SGLang); the client reads the
context from GET /v1/models (`max_model_len`) and lowers each request's budget, so a multi-turn session
whose history nears the context still completes against such an engine (runtime/tests/session/
test_session_context.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from lockstep.engine import ReferenceEngine, create_app
from lockstep.serving import EngineClient, SamplingParams
from lockstep.serving.context_fit import ContextFull

CONTEXT = 96
PROMPT = list(range(2, 42))  # 40 tokens


async def _serve(tiny_dir: Path, **kw: Any) -> AsyncIterator[tuple[ReferenceEngine, str]]:
    engine = ReferenceEngine.load(tiny_dir, max_running_requests=4, context_length=CONTEXT, seed=0, **kw)
    server = TestServer(create_app(engine), host="127.0.0.1")
    await server.start_server()
    try:
        yield engine, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.fixture
async def stock(tiny_dir: Path) -> AsyncIterator[tuple[ReferenceEngine, str]]:
    """An engine with SGLang's default: requests beyond the context are refused."""
    async for s in _serve(tiny_dir):
        yield s


def _body(ids: list[int], max_new: int) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}


async def test_the_client_asks_only_for_what_fits(stock: tuple[ReferenceEngine, str]) -> None:
    _, url = stock
    async with EngineClient(url) as client:
        assert await client.context_length() == CONTEXT
        res = await client.generate(PROMPT, SamplingParams(max_new_tokens=500, ignore_eos=True))
        assert len(res.output_ids) == CONTEXT - len(PROMPT) and res.finish_reason == "length"
        with pytest.raises(ContextFull, match=f"{CONTEXT} tokens and the engine's context is {CONTEXT}"):
            await client.generate(list(range(2, 2 + CONTEXT)), SamplingParams(max_new_tokens=1))
