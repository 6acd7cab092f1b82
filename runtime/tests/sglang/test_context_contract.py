"""The reference engine's context rule against the pinned SGLang's: its 400, its flag, its model card.

The reference engine used to cap max_new_tokens silently; stock SGLang (no --allow-auto-truncate)
answers 400 instead. Now the engine answers SGLang's 400 with SGLang's message (its fragments read
from the pinned wheel's tokenizer_manager.py), `--allow-auto-truncate` is parsed by SGLang's own parser
and by ours with the same spelling and restores the cap, and GET /v1/models carries the context as
SGLang's `max_model_len`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp.test_utils import TestServer
from lockstep.cli import build_parser
from lockstep.engine import ReferenceEngine, create_app
from lockstep.models.tiny import materialize_builtin
from sglang_oracle import parse_server_args, require_pinned_sglang, source

CONTEXT = 96
PROMPT = list(range(2, 42))  # 40 tokens


@pytest.fixture(autouse=True, scope="module")
def _pinned() -> None:
    require_pinned_sglang()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = materialize_builtin("builtin:tiny", tmp_path_factory.mktemp("tiny"), seed=0)
    return path


async def _serve(tiny_dir: Path, **kw: Any) -> AsyncIterator[str]:
    engine = ReferenceEngine.load(tiny_dir, max_running_requests=4, context_length=CONTEXT, seed=0, **kw)
    server = TestServer(create_app(engine), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def _body(ids: list[int], max_new: int) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}


async def test_a_request_beyond_the_context_is_sglangs_400(tiny_dir: Path) -> None:
    sglang = source("srt/managers/tokenizer_manager.py").read_text()
    async for url in _serve(tiny_dir):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            total = await http.post("/generate", json=_body(PROMPT, 57))  # 40 + 57 = 97 > 96
            assert total.status_code == 400, total.text
            message = total.json()["error"]
            assert message.startswith(
                f"Requested token count exceeds the model's maximum context length of {CONTEXT}"
            )
            assert (
                "You requested a total of 97 tokens: 40 tokens from the input messages and 57 tokens"
                in message
            )
            for fragment in (
                "Requested token count exceeds the model's maximum context length ",
                "Please reduce the number ",
                "of tokens in the input messages or the completion to fit within the limit.",
                "The input ({input_token_num} tokens) is longer than the ",
                "model's context length ({self.context_len} tokens).",
            ):
                assert fragment in sglang, fragment  # SGLang's own words
            long = await http.post("/generate", json=_body(list(range(2, 2 + CONTEXT)), 1))
            assert long.status_code == 400 and long.json()["error"] == (
                f"The input ({CONTEXT} tokens) is longer than the model's context length ({CONTEXT} tokens)."
            )
            fits = await http.post("/generate", json=_body(PROMPT, 56))  # exactly the context
            assert fits.status_code == 200 and fits.json()["meta_info"]["completion_tokens"] == 56
            models = (await http.get("/v1/models")).json()
            assert models["data"][0]["max_model_len"] == CONTEXT


async def test_allow_auto_truncate_is_sglangs_flag_and_truncates(tiny_dir: Path) -> None:
    assert parse_server_args(["--model-path", "/m", "--allow-auto-truncate"]).allow_auto_truncate is True
    assert parse_server_args(["--model-path", "/m"]).allow_auto_truncate is False  # SGLang's default
    ours = build_parser().parse_args(["engine", "--model", "builtin:tiny", "--allow-auto-truncate"])
    assert ours.allow_auto_truncate is True
    assert build_parser().parse_args(["engine", "--model", "builtin:tiny"]).allow_auto_truncate is False
    async for url in _serve(tiny_dir, allow_auto_truncate=True):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            r = await http.post("/generate", json=_body(PROMPT, 500))
            assert r.status_code == 200, r.text
            meta = r.json()["meta_info"]
            assert meta["completion_tokens"] == CONTEXT - len(PROMPT)
            assert meta["finish_reason"]["type"] == "length"
