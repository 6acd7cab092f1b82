"""Fixtures for the terminal-agent tests: a real reference engine on 127.0.0.1 serving a tiny model that
has learned two short shell episodes, so greedy decoding proposes a real `sh` tool call.

The checkpoint is the built-in tiny model trained for a few seconds on EPISODES; the engine, the
in-process session server, the openai client and the local sandbox are the real components.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web
from memorized import memorized_tiny

WRITE_CALL = '<call>{"name":"sh","arguments":{"cmd":"echo 7 > ab"}}</call>'
SHOW_CALL = '<call>{"name":"sh","arguments":{"cmd":"cat ab"}}</call>'
EPISODES = (
    f"<|user|>write 7 to ab<|assistant|>{WRITE_CALL}<|eos|><|tool|><|assistant|>done<|eos|>",
    f"<|user|>show ab<|assistant|>{SHOW_CALL}<|eos|><|tool|>7\n<|assistant|>it is 7<|eos|>",
)


@pytest.fixture(scope="session")
def episodes() -> tuple[str, ...]:
    """The episodes the trained tiny model reproduces under greedy decoding."""
    return EPISODES


@pytest.fixture(scope="session")
def shell_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint that greedily reproduces EPISODES (trained once per test run)."""
    return memorized_tiny(
        EPISODES, tmp_path_factory.mktemp("tiny-base"), tmp_path_factory.mktemp("tiny-shell"), steps=80
    )


@pytest_asyncio.fixture
async def engine_url(shell_tiny: Path) -> AsyncIterator[str]:
    """The reference engine (`lockstep engine`'s app) serving the trained tiny model."""
    from lockstep.engine.core import ReferenceEngine
    from lockstep.engine.server import create_app

    engine = ReferenceEngine.load(shell_tiny, max_running_requests=4, context_length=512)
    runner = web.AppRunner(create_app(engine), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
