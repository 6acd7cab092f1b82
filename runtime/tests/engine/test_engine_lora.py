"""Multi-LoRA serving in the reference engine, through its real HTTP server and the real EngineClient.

What must hold: base + adapter logprobs equal the trainer's (peft on FSDP) for the same tokens; an
adapter loads from a peft directory and from tensors sent in the request (checksums checked), never
under a name already loaded; requests of one adapter sample exactly as before while another adapter
is loaded, updated (a new name) or unloaded; the prefix cache never serves one adapter's KV to
another; what stock SGLang refuses (rank above --max-lora-rank, a target outside the engine's
modules) is refused with its reason; unload waits for the requests that use the adapter.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from aiohttp.test_utils import TestServer
from lockstep.engine import ReferenceEngine, create_app
from lockstep.engine.lora_routes import tensor_sha256
from lockstep.serving import EngineClient, EngineError, SamplingParams
from lockstep.serving.tensor_codec import dumps_tensors_by_value
from lockstep.train.common.losses import sft_loss
from lockstep.train.common.packing import pack_sft
from lockstep.train.fsdp import FSDPBackend, FSDPConfig
from lockstep.train.fsdp.lora import AdapterConfig, save_adapter

PROMPT = [2, 20, 21, 22, 3]


@dataclass
class Trained:
    """A peft adapter trained a few SFT steps (so it changes the policy), and its trainer."""

    backend: FSDPBackend
    tensors: dict[str, torch.Tensor]
    config: dict[str, object]


def _train(model_dir: Path, seed: int, steps: int = 4, rank: int = 4) -> Trained:
    cfg = AdapterConfig(rank=rank, alpha=2 * rank, name="a")
    b = FSDPBackend(FSDPConfig(model_path=model_dir, lr=3e-2, device="cpu", seed=seed, lora=cfg))
    batch = pack_sft([([2, 20, 21, 3], [30 + seed, 31, 1]), ([2, 22, 3], [40, 41 + seed, 1])])
    for _ in range(steps):
        b.train_step(batch, sft_loss)
    tensors = {n: t.clone() for n, t in b.export_weights()}
    return Trained(b, tensors, b.adapter_config())


@pytest.fixture(scope="module")
def trained(tiny_dir: Path) -> AsyncIterator[tuple[Trained, Trained]]:
    one, two = _train(tiny_dir, 1), _train(tiny_dir, 2)
    yield one, two
    one.backend.close()
    two.backend.close()


@pytest.fixture
async def client(tiny_dir: Path) -> AsyncIterator[tuple[EngineClient, ReferenceEngine]]:
    engine = ReferenceEngine.load(tiny_dir)
    engine.enable_lora(max_rank=8)
    server = TestServer(create_app(engine), host="127.0.0.1")
    await server.start_server()
    try:
        async with EngineClient(str(server.make_url("")), retries=1) as c:
            yield c, engine
    finally:
        await server.close()


async def _load(c: EngineClient, name: str, t: Trained) -> None:
    sums = {n: tensor_sha256(v) for n, v in t.tensors.items()}
    await c.load_lora_adapter_from_tensors(
        name, t.config, dumps_tensors_by_value(t.tensors.items()), expected_checksums=sums
    )


def _trainer_logprobs(
    b: FSDPBackend, prompt: list[int], response: list[int], temperature: float
) -> list[float]:
    batch = pack_sft([(prompt, response)])
    batch.temperature = temperature
    lp = b.compute_logprobs(batch)[0]
    return [float(x) for x in lp[len(prompt) - 1 : len(prompt) - 1 + len(response)]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_engine_logprobs_with_an_adapter_equal_the_trainers(
    client: tuple[EngineClient, ReferenceEngine], trained: tuple[Trained, Trained], temperature: float
) -> None:
    c, _ = client
    one, _two = trained
    await _load(c, "one-v1", one)
    sp = SamplingParams(max_new_tokens=8, temperature=temperature, sampling_seed=5, ignore_eos=True)
    r = await c.generate(PROMPT, sp, lora_path="one-v1")
    want = _trainer_logprobs(one.backend, PROMPT, r.output_ids, temperature)
    assert max(abs(a - b) for a, b in zip(r.output_logprobs, want, strict=True)) < 1e-4
    base = await c.generate(PROMPT, sp)  # the base alone: another policy
    assert base.output_logprobs != r.output_logprobs


async def test_an_adapter_loads_from_a_peft_directory(
    client: tuple[EngineClient, ReferenceEngine], trained: tuple[Trained, Trained], tmp_path: Path
) -> None:
    c, engine = client
    one, _ = trained
    save_adapter(tmp_path / "ad", one.tensors, one.config)
    reply = await c.load_lora_adapter("dir", str(tmp_path / "ad"))
    assert reply.loaded_adapters == {"dir": str(tmp_path / "ad")}
    assert engine.adapters is not None
    held = engine.adapters.tensors("dir")
    assert set(held) == set(one.tensors) and all(torch.equal(held[n], one.tensors[n]) for n in held)
    with pytest.raises(EngineError, match="already loaded"):
        await c.load_lora_adapter("dir", str(tmp_path / "ad"))


async def test_v1_models_lists_the_loaded_adapters_as_sglang_does(
    client: tuple[EngineClient, ReferenceEngine], trained: tuple[Trained, Trained]
) -> None:
    # what the driver's per-engine adapter-version probe and a restarted trainer's sweep read
    from sglang.srt.entrypoints.openai.protocol import ModelList

    c, engine = client
    one, two = trained
    assert (await c.list_models()).adapters() == []
    await _load(c, "one-v1", one)
    await _load(c, "two-v3", two)
    listed = await c.list_models()
    assert sorted(listed.adapters()) == ["one-v1", "two-v3"]
    assert listed.data[0].parent is None and {d.parent for d in listed.data[1:]} == {engine.model_path}
    ModelList.model_validate(listed.model_dump())  # SGLang's own reply model
    await c.unload_lora_adapter("one-v1")
    assert (await c.list_models()).adapters() == ["two-v3"]


async def test_one_adapters_samples_never_change_when_another_loads_or_unloads(
    client: tuple[EngineClient, ReferenceEngine], trained: tuple[Trained, Trained]
) -> None:
    c, _ = client
    one, two = trained
    await _load(c, "one-v1", one)
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=11, ignore_eos=True)
    before = await c.generate(PROMPT, sp, lora_path="one-v1")
    await _load(c, "two-v1", two)
    # Alone, or in one batch with the other adapter's rows: the same tokens, the same logprobs up to
    # the float noise of batch shapes and prefix-cache reuse (1e-5; another adapter's update is 1e-1).
    alone = await c.generate(PROMPT, sp, lora_path="one-v1")
    both = await asyncio.gather(
        c.generate(PROMPT, sp, lora_path="one-v1"), c.generate(PROMPT, sp, lora_path="two-v1")
    )
    await c.unload_lora_adapter("two-v1")
    after = await c.generate(PROMPT, sp, lora_path="one-v1")
    for got in (alone, both[0], after):
        assert got.output_ids == before.output_ids
        assert _gap(got.output_logprobs, before.output_logprobs) < 1e-5
    assert _gap(both[1].output_logprobs, before.output_logprobs) > 1e-2  # the other adapter is another policy
    with pytest.raises(EngineError, match="not loaded"):
        await c.generate(PROMPT, sp, lora_path="two-v1")


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def test_the_prefix_cache_is_per_adapter(
    client: tuple[EngineClient, ReferenceEngine], trained: tuple[Trained, Trained]
) -> None:
    c, _ = client
    one, _two = trained
    await _load(c, "one-v1", one)
    sp = SamplingParams(max_new_tokens=1, temperature=0.0)
    first = await c.generate(PROMPT, sp, lora_path="one-v1")
    base = await c.generate(PROMPT, sp)
    again = await c.generate(PROMPT, sp, lora_path="one-v1")
    assert base.cached_tokens == 0  # the adapter's KV is not the base's
    assert again.cached_tokens > 0 and _gap(again.output_logprobs, first.output_logprobs) < 1e-5


async def test_what_sglang_refuses_is_refused_with_its_reason(
    client: tuple[EngineClient, ReferenceEngine], tiny_dir: Path
) -> None:
    c, engine = client
    big = _train(tiny_dir, 3, steps=0, rank=16)
    with pytest.raises(EngineError, match=r"rank 16 is incompatible.*--max-lora-rank is 8"):
        await _load(c, "big", big)
    big.backend.close()
    ok = _train(tiny_dir, 4, steps=1)
    bad = {n.replace("q_proj", "qkv_proj"): t for n, t in ok.tensors.items()}
    with pytest.raises(EngineError, match="not among this engine's LoRA target modules"):
        await c.load_lora_adapter_from_tensors("bad", ok.config, dumps_tensors_by_value(bad.items()))
    sums = {n: tensor_sha256(t) for n, t in ok.tensors.items()}
    name = next(iter(sums))
    sums[name] = "0" * 64
    with pytest.raises(EngineError, match=r"LORA-CHECK.*1 value-diff"):
        await c.load_lora_adapter_from_tensors(
            "sum", ok.config, dumps_tensors_by_value(ok.tensors.items()), expected_checksums=sums
        )
    ok.backend.close()
    assert engine.adapters is not None and engine.adapters.adapters == {}  # nothing half-loaded


async def test_unload_waits_for_the_requests_that_use_the_adapter(
    client: tuple[EngineClient, ReferenceEngine], trained: tuple[Trained, Trained]
) -> None:
    c, engine = client
    one, _ = trained
    await _load(c, "one-v1", one)
    await c.pause_generation("in_place")
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, sampling_seed=1, ignore_eos=True)
    running = asyncio.create_task(c.generate(PROMPT, sp, lora_path="one-v1"))
    await asyncio.sleep(0.2)
    unload = asyncio.create_task(c.unload_lora_adapter("one-v1"))
    await asyncio.sleep(0.2)
    assert not unload.done()  # the request using it holds it
    with pytest.raises(EngineError, match="not loaded"):  # but no new request may name it
        await c.generate(PROMPT, sp, lora_path="one-v1")
    await c.continue_generation()
    result = await running
    assert len(result.output_ids) == 4
    await unload
    assert engine.adapters is not None and "one-v1" not in engine.adapters.adapters


async def test_without_enable_lora_the_routes_answer_sglangs_error(tiny_dir: Path) -> None:
    server = TestServer(create_app(ReferenceEngine.load(tiny_dir)), host="127.0.0.1")
    await server.start_server()
    try:
        async with EngineClient(str(server.make_url("")), retries=1) as c:
            with pytest.raises(EngineError, match="LoRA is not enabled"):
                await c.unload_lora_adapter("x")
            with pytest.raises(EngineError, match="--enable-lora"):
                await c.generate(PROMPT, SamplingParams(max_new_tokens=1), lora_path="x")
    finally:
        await server.close()
