"""Fixtures for the session-server tests: a real reference engine on 127.0.0.1 serving a tiny model
that has learned two short conversations (so greedy decoding reproduces a real tool call).

The checkpoint is the built-in tiny model trained for a few seconds on TRAINED_CONVERSATIONS; the
engine, the session server and the openai client are the real components.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web
from memorized import memorized_tiny

TOOL_CALL = '<call>{"name":"calc","arguments":{"a":2,"b":3}}</call>'
TRAINED_CONVERSATIONS = (
    f"<|user|>add 2 and 3<|assistant|>{TOOL_CALL}<|eos|><|tool|>5<|assistant|>the sum is 5<|eos|>",
    "<|user|>hi<|assistant|>hello<|eos|><|user|>bye<|assistant|>bye now<|eos|>",
    '<|user|>calc 2+3<|assistant|><call>{"name":"calc","arguments":{"expression":"2+3"}}</call><|eos|>'
    "<|tool|>5<|assistant|>5<|eos|>",
)


@pytest.fixture(scope="session")
def conversations() -> tuple[str, ...]:
    """The conversations the trained tiny model reproduces under greedy decoding."""
    return TRAINED_CONVERSATIONS


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint that greedily reproduces TRAINED_CONVERSATIONS (trained once per test run)."""
    return memorized_tiny(
        TRAINED_CONVERSATIONS,
        tmp_path_factory.mktemp("tiny-base"),
        tmp_path_factory.mktemp("tiny-tools"),
        steps=60,
    )


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


@pytest_asyncio.fixture
async def engine_url(trained_tiny: Path) -> AsyncIterator[str]:
    """The reference engine (`lockstep engine`'s app) serving the trained tiny model."""
    from lockstep.engine.core import ReferenceEngine
    from lockstep.engine.server import create_app

    engine = ReferenceEngine.load(trained_tiny, max_running_requests=4, context_length=512)
    runner, url = await _serve(create_app(engine))
    try:
        yield url
    finally:
        await runner.cleanup()
