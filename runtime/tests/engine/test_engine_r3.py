"""R3 on the reference engine: routed_experts over real HTTP equal an independent HF Qwen3-MoE forward.

The engine serves builtin:tiny-moe on 127.0.0.1; the runtime's EngineClient asks for
return_routed_experts; the payload must decode to SGLang's [prompt + output - 1, layers, top-k] and
hold, row i, the experts HF's own router picks for token i when the whole sequence is run at once
(so prefill, decode and prefix-cache reuse all record the same routing a plain forward computes).
A dense model refuses the request with a clear 400. The rollout's R3 client asks for routing on
every request and refuses an engine that answers without it.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from aiohttp.test_utils import TestServer
from lockstep.engine import ReferenceEngine, create_app
from lockstep.models.tiny import chat_tokenizer, materialize_builtin
from lockstep.rollout.generate import RoutedExpertsClient, RoutedExpertsError, single_turn
from lockstep.rollout.plugins import RolloutContext
from lockstep.serving import EngineClient, EngineError, GenerateResult, SamplingParams
from lockstep.train.common.r3 import decode_routed_experts
from lockstep.types import Sample
from transformers import Qwen3MoeForCausalLM

TOK = chat_tokenizer()
LAYERS, TOP_K, EXPERTS = 2, 2, 8


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = materialize_builtin("builtin:tiny-moe", tmp_path_factory.mktemp("tinymoe"), seed=0)
    return path


async def _serve(path: Path) -> AsyncIterator[tuple[ReferenceEngine, EngineClient, str]]:
    engine = ReferenceEngine.load(path, max_running_requests=8, context_length=128, seed=0)
    server = TestServer(create_app(engine), host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    client = EngineClient(url, retries=2, backoff_s=0.01)
    try:
        yield engine, client, url
    finally:
        await client.aclose()
        await server.close()


@pytest.fixture
async def moe(moe_dir: Path) -> AsyncIterator[tuple[ReferenceEngine, EngineClient, str]]:
    async for s in _serve(moe_dir):
        yield s


def _hf_topk(path: Path, tokens: list[int]) -> torch.Tensor:
    """Independent reference: HF's full-sequence forward; top-k of each layer's router -> [n, L, k]."""
    model: Any = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    per_layer = [torch.topk(torch.softmax(lg.float(), -1), TOP_K, dim=-1).indices for lg in out.router_logits]
    return torch.stack(per_layer, dim=1)  # [n, L, k]


async def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    """A stock HTTP client's POST: what any caller of the engine may send."""
    async with httpx.AsyncClient(timeout=60) as http:
        return await http.post(url, json=body)


async def test_routed_experts_over_http_equal_an_hf_forward(
    moe: tuple[ReferenceEngine, EngineClient, str], moe_dir: Path
) -> None:
    engine, client, _ = moe
    prompt = TOK.render([{"role": "user", "content": "what is 2+3?"}], add_generation_prompt=True)
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True, sampling_seed=3)
    # A group sharing the prompt: later members reuse the first one's prompt KV while it runs
    # (prefix copy between slots), so their prompt routing must come along with that KV.
    group = await asyncio.gather(
        *(
            client.generate(prompt, sp.model_copy(update={"sampling_seed": i}), return_routed_experts=True)
            for i in range(3)
        )
    )
    # Same prompt again after they finished: the prompt comes from a free slot's cached KV.
    again = await client.generate(
        prompt, sp.model_copy(update={"sampling_seed": 9}), return_routed_experts=True
    )
    assert again.cached_tokens > 0 and any(r.cached_tokens > 0 for r in group)
    for res in [*group, again]:
        tokens = prompt + res.output_ids
        assert res.routed_experts is not None
        assert len(res.routed_experts) == (len(tokens) - 1) * LAYERS * TOP_K * 4  # §4.1 cost formula
        got = decode_routed_experts(res.routed_experts, len(tokens), LAYERS, TOP_K, num_experts=EXPERTS)
        assert got.shape == (len(tokens) - 1, LAYERS, TOP_K)
        want = _hf_topk(moe_dir, tokens)[:-1]  # the last token was sampled, never run: no row
        assert torch.equal(got, want)
    assert engine.is_moe


async def test_payload_is_base64_int32_and_absent_unless_asked(
    moe: tuple[ReferenceEngine, EngineClient, str],
) -> None:
    _, _client, url = moe
    body = {"input_ids": [2, 20, 21, 3], "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}}
    plain = (await _post(url + "/generate", body)).json()
    assert "routed_experts" not in plain["meta_info"]
    asked = (await _post(url + "/generate", {**body, "return_routed_experts": True})).json()
    raw = base64.b64decode(asked["meta_info"]["routed_experts"])
    n = 4 + len(asked["output_ids"])
    assert len(raw) == (n - 1) * LAYERS * TOP_K * 4
    ids = torch.frombuffer(bytearray(raw), dtype=torch.int32)
    assert int(ids.min()) >= 0 and int(ids.max()) < EXPERTS


async def test_scoring_only_request_covers_the_prompt(
    moe: tuple[ReferenceEngine, EngineClient, str], moe_dir: Path
) -> None:
    """max_new_tokens 0 (OPD-style scoring): rows for prompt tokens 0..P-2."""
    _, client, _ = moe
    prompt = [2, 30, 31, 32, 33, 34, 3]
    res = await client.generate(prompt, SamplingParams(max_new_tokens=0), return_routed_experts=True)
    assert res.output_ids == [] and res.routed_experts is not None
    got = decode_routed_experts(res.routed_experts, len(prompt), LAYERS, TOP_K)
    assert torch.equal(got, _hf_topk(moe_dir, prompt)[:-1])


async def test_dense_model_refuses_return_routed_experts(tiny_dir: Path) -> None:
    async for _engine, _client, url in _serve(tiny_dir):
        body = {"input_ids": [2, 20, 3], "return_routed_experts": True}
        resp = await _post(url + "/generate", body)
        assert resp.status_code == 400
        assert "return_routed_experts: this is a dense model" in resp.json()["error"]


async def test_single_turn_through_the_r3_client_fills_the_sample(
    moe: tuple[ReferenceEngine, EngineClient, str],
) -> None:
    _, client, _ = moe
    ctx = RolloutContext(
        client=RoutedExpertsClient(client),
        sampling=SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True),
        decode=lambda ids: TOK.decode(ids, skip_special_tokens=True),
        encode=TOK.encode,
    )
    sample = await single_turn(ctx, Sample(group_index=0, index=0, prompt_ids=[2, 20, 21, 3]))
    assert sample.routed_experts is not None
    assert len(sample.routed_experts) == (4 + len(sample.response_ids) - 1) * LAYERS * TOP_K * 4


async def test_r3_client_refuses_an_engine_without_routing_data(tiny_dir: Path) -> None:
    async for _engine, client, _url in _serve(tiny_dir):
        with pytest.raises(EngineError, match="dense model"):  # our engine: 400 naming the field
            await RoutedExpertsClient(client).generate([2, 20, 3], SamplingParams(max_new_tokens=2))

    class NoRouting:  # an SGLang started without --enable-return-routed-experts ignores the flag
        async def generate(self, input_ids: Any, sampling_params: Any = None, **kw: Any) -> GenerateResult:
            return GenerateResult(
                output_ids=[5],
                output_logprobs=[-0.1],
                finish_reason="length",
                weight_version=0,
                token_versions=[0],
                prompt_tokens=len(input_ids),
                cached_tokens=0,
            )

    with pytest.raises(RoutedExpertsError, match="--enable-return-routed-experts"):
        await RoutedExpertsClient(NoRouting()).generate([2, 20, 3])
