"""Scoring exact token IDs on the reference engine, as a teacher does (docs/distillation.md).

Through the real HTTP server and EngineClient.score on 127.0.0.1: a row's own logprobs, the top-K and
the listed IDs' logprobs at each position equal an independent full-sequence forward of HF's
Qwen3ForCausalLM (log_softmax of the raw logits), laid out as SGLang lays them out (entry 0 None
whatever the start), with or without the prefix cache; /v1/detokenize decodes each ID as the
checkpoint's tokenizer does; requests the engine cannot serve are refused naming the field.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestServer
from lockstep.engine import ReferenceEngine, create_app
from lockstep.models.tiny import chat_tokenizer
from lockstep.serving import EngineClient, EngineError, SamplingParams
from transformers import Qwen3ForCausalLM

TOK = chat_tokenizer()


@pytest.fixture
async def client(tiny_dir: Path) -> AsyncIterator[EngineClient]:
    engine = ReferenceEngine.load(tiny_dir, max_running_requests=8, context_length=256, seed=0)
    server = TestServer(create_app(engine, stock=True), host="127.0.0.1")
    await server.start_server()
    c = EngineClient(str(server.make_url("")).rstrip("/"), retries=2, backoff_s=0.01)
    try:
        yield c
    finally:
        await c.aclose()
        await server.close()


def _row() -> list[int]:
    ids: list[int] = TOK.render([{"role": "user", "content": "reverse 1234"}], add_generation_prompt=True)
    return ids + TOK.encode("4321")


def _hf_logprobs(path: Path, ids: list[int]) -> torch.Tensor:
    """[T, V] log_softmax of an independent HF forward (row t predicts token t+1)."""
    model: Any = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("warm", [False, True])
async def test_a_row_is_scored_as_an_hf_forward_scores_it(
    client: EngineClient, tiny_dir: Path, warm: bool
) -> None:
    ids = _row()
    start = len(ids) - 5
    if warm:  # the prompt's KV is in the prefix cache: scores must not change
        await client.generate(ids[:start], SamplingParams(max_new_tokens=1))
    wanted = [3, 7, ids[-1]]
    row = await client.score(ids, start, top_k=4, token_ids=wanted)
    ref = _hf_logprobs(tiny_dir, ids)
    n = len(ids) - start
    assert len(row.chosen) == n and row.chosen[0] is None  # SGLang: nothing predicts token `start`
    assert row.top is not None and row.token_ids is not None
    assert row.top[0] is None and row.token_ids[0] is None
    for i in range(1, n):
        pos = start + i
        assert row.chosen[i] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-5)
        vals, top = ref[pos - 1].topk(4)
        got = row.top[i]
        assert got is not None and [t for t, _ in got] == top.tolist()
        assert [v for _, v in got] == pytest.approx(vals.tolist(), abs=1e-5)
        listed = row.token_ids[i]
        assert listed is not None and [t for t, _ in listed] == wanted
        assert [v for _, v in listed] == pytest.approx([ref[pos - 1, t].item() for t in wanted], abs=1e-5)
    assert row.prompt_tokens == len(ids) and row.reply_bytes > 0


async def test_only_the_chosen_logprobs_when_nothing_else_is_asked(client: EngineClient) -> None:
    ids = _row()
    row = await client.score(ids, 0)
    assert row.top is None and row.token_ids is None
    assert row.chosen[0] is None and all(isinstance(v, float) for v in row.chosen[1:])


async def test_detokenize_decodes_each_id_as_the_tokenizer_does(client: EngineClient) -> None:
    ids = [*range(40), TOK.eos_token_id]
    texts = await client.detokenize([[i] for i in ids])
    assert texts == [TOK.decode([i], skip_special_tokens=False) for i in ids]


async def test_what_the_engine_cannot_score_is_refused_naming_the_field(client: EngineClient) -> None:
    import httpx

    ids = _row()
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 3}  # fmt: skip
    async with httpx.AsyncClient(timeout=60) as http:
        reply = await http.post(client.base_url + "/generate", json=body)
    assert reply.status_code == 400 and "scoring request" in reply.json()["error"]
    with pytest.raises(EngineError, match="outside the vocabulary"):
        await client.score(ids, 1, token_ids=[10**9])
