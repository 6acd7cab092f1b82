"""The reference engine through its real HTTP server and the real EngineClient, on 127.0.0.1.

Checks the equalities the trainer relies on: the logprob the engine returns for a sampled token is
the one an independent full-sequence forward of HF's Qwen3ForCausalLM gives (log_softmax(logits / T)),
batching changes nothing, the prefix cache changes nothing, and weight versions per token tell the
truth across a retract-mode weight update.
"""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from aiohttp.test_utils import TestServer
from lockstep.engine import ReferenceEngine, create_app
from lockstep.models.tiny import chat_tokenizer
from lockstep.rollout.staleness import measure_staleness
from lockstep.serving import (
    EngineClient,
    EngineError,
    GenerateReply,
    GenerateResult,
    SamplingParams,
    dumps_named_tensors,
)
from lockstep.serving.weight_group import open_weight_update_group
from safetensors.torch import load_file
from transformers import Qwen3ForCausalLM

TOK = chat_tokenizer()


@dataclass
class Served:
    engine: ReferenceEngine
    client: EngineClient
    url: str


async def _serve(
    path: Path, allow_tensor_updates: bool = False, stock: bool = False
) -> AsyncIterator[Served]:
    engine = ReferenceEngine.load(path, max_running_requests=8, context_length=256, seed=0)
    app = create_app(engine, allow_tensor_updates=allow_tensor_updates, stock=stock)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    client = EngineClient(url, retries=2, backoff_s=0.01)
    try:
        yield Served(engine, client, url)
    finally:
        await client.aclose()
        await server.close()


@pytest.fixture
async def served(tiny_dir: Path) -> AsyncIterator[Served]:
    async for s in _serve(tiny_dir):
        yield s


@pytest.fixture
async def served_stock(tiny_dir: Path) -> AsyncIterator[Served]:
    """Only what stock SGLang serves (no extension route or reply field)."""
    async for s in _serve(tiny_dir, stock=True):
        yield s


@pytest.fixture
async def served_tensor(tiny_dir: Path) -> AsyncIterator[Served]:
    async for s in _serve(tiny_dir, allow_tensor_updates=True):
        yield s


def _prompt(text: str) -> list[int]:
    ids: list[int] = TOK.render([{"role": "user", "content": text}], add_generation_prompt=True)
    return ids


def _reference_logprobs(path: Path, prompt: list[int], out: list[int], temperature: float) -> list[float]:
    """Independent full-sequence forward of the HF model: logprob of each output token."""
    model: Any = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0].float()  # [P+R, V]
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return [logp[len(prompt) - 1 + j, tok].item() for j, tok in enumerate(out)]


async def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    """A stock HTTP client's POST: what any caller of the engine may send."""
    async with httpx.AsyncClient(timeout=60) as http:
        return await http.post(url, json=body)


async def _wait_tokens(served: Served, n: int) -> None:
    """Poll (no timing assertion) until the engine has sampled at least n tokens."""
    while served.engine.stats.generated_tokens < n:
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
async def test_logprobs_equal_full_forward(served: Served, tiny_dir: Path, temperature: float) -> None:
    prompt = _prompt("what is 2+3?")
    sp = SamplingParams(max_new_tokens=24, temperature=temperature, ignore_eos=True, sampling_seed=7)
    res = await served.client.generate(prompt, sp)
    assert len(res.output_ids) == 24 and res.finish_reason == "length"
    ref = _reference_logprobs(tiny_dir, prompt, res.output_ids, temperature)
    assert res.output_logprobs == pytest.approx(ref, abs=1e-5)
    assert res.token_versions == [0] * 24 and res.weight_version == 0


async def test_batched_equals_unbatched_greedy_and_seeded(served: Served) -> None:
    prompts = [_prompt(f"count to {i}") for i in range(6)]
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    together = await asyncio.gather(*(served.client.generate(p, greedy) for p in prompts))
    alone = [await served.client.generate(p, greedy) for p in prompts]
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]
    seeded = SamplingParams(max_new_tokens=16, temperature=1.0, sampling_seed=3, ignore_eos=True)
    a = await asyncio.gather(*(served.client.generate(p, seeded) for p in prompts))
    b = [await served.client.generate(p, seeded) for p in prompts]
    assert [r.output_ids for r in a] == [r.output_ids for r in b]


async def test_prefix_cache_hit_gives_identical_outputs(served: Served) -> None:
    prompt = _prompt("the same long prompt, reused by every sample of a group")
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    first = await served.client.generate(prompt, sp)
    second = await served.client.generate(prompt, sp)
    assert first.cached_tokens == 0
    assert second.cached_tokens == len(prompt) - 1  # all but the last prompt token, recomputed for its logits
    assert second.output_ids == first.output_ids
    assert second.output_logprobs == pytest.approx(first.output_logprobs, abs=1e-5)
    await served.client.flush_cache()
    third = await served.client.generate(prompt, sp)
    assert third.cached_tokens == 0 and third.output_ids == first.output_ids
    assert served.engine.stats.prefix_cache_hit_rate > 0


async def test_group_samples_share_the_prompt_prefill(served: Served) -> None:
    prompt = _prompt("one prompt, four samples")
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    results = await asyncio.gather(*(served.client.generate(prompt, sp) for _ in range(4)))
    assert sorted(r.cached_tokens for r in results) == [0] + [len(prompt) - 1] * 3


async def test_retract_keeps_tokens_and_records_new_version(served: Served, tiny_dir_b: Path) -> None:
    prompt = _prompt("a long answer please")
    sp = SamplingParams(max_new_tokens=120, temperature=1.0, ignore_eos=True, sampling_seed=1)
    task = asyncio.create_task(served.client.generate(prompt, sp))
    await _wait_tokens(served, 3)
    await served.client.pause_generation("retract")
    await served.client.update_weights_from_disk(str(tiny_dir_b), weight_version=1)
    await served.client.continue_generation()
    res: GenerateResult = await task
    assert len(res.output_ids) == 120 and res.finish_reason == "length"
    switch = res.token_versions.index(1)
    assert switch >= 3 and set(res.token_versions[:switch]) == {0} and set(res.token_versions[switch:]) == {1}
    assert res.weight_version == 1
    # Tokens after the switch were sampled by the new weights over the whole (recomputed) prefix.
    ref = _reference_logprobs(tiny_dir_b, prompt, res.output_ids, 1.0)
    assert res.output_logprobs[switch:] == pytest.approx(ref[switch:], abs=1e-5)


async def test_weights_checker_has_sglangs_semantics(served_stock: Served) -> None:
    """snapshot / reset_tensors / compare / checksum as SGLang's WeightChecker: compare names each reset
    tensor, skip_tensor_list leaves tensors alone in every action, compare needs a snapshot."""
    c = served_stock.client
    no_snapshot = await c.check_weights("compare")
    assert not no_snapshot.success and "call action 'snapshot' first" in no_snapshot.message
    before = await c.check_weights("checksum")
    assert before.success and before.ranks and before.per_engine_checksum
    assert (await c.check_weights("snapshot")).success
    assert (await c.check_weights("reset_tensors", skip_tensor_list=["norm"])).success
    failed = await c.check_weights("compare")
    named = {line.split()[0].removeprefix("name=") for line in failed.message.splitlines()[1:]}
    weights = set(served_stock.engine.named_weights())
    assert not failed.success and named == {n for n in weights if "norm" not in n}
    after = await c.check_weights("checksum", skip_tensor_list=["norm"])
    assert after.ranks and set(after.ranks[0].checksums) == {n for n in weights if "norm" not in n}
    kept = {n: v for n, v in before.ranks[0].checksums.items() if "norm" in n}
    assert kept == {
        n: v for n, v in (await c.check_weights("checksum")).ranks[0].checksums.items() if "norm" in n
    }
    async with httpx.AsyncClient(base_url=served_stock.url) as http:
        draft = await http.post("/weights_checker", json={"action": "checksum", "selector": "draft"})
        assert draft.status_code == 400 and "no speculative draft model" in draft.json()["message"]


async def test_stock_mode_reports_per_token_versions_as_sglang_does(
    served_stock: Served, tiny_dir_b: Path
) -> None:
    """Stock SGLang's meta_info.weight_versions spans carry the versions: a request retracted across an
    update counts every token in the coverage metric, with the switch where it happened."""
    prompt = _prompt("a long answer please")
    sp = SamplingParams(max_new_tokens=60, temperature=1.0, ignore_eos=True, sampling_seed=1)
    task = asyncio.create_task(served_stock.client.generate(prompt, sp))
    await _wait_tokens(served_stock, 3)
    await served_stock.client.pause_generation("retract")
    await served_stock.client.update_weights_from_disk(str(tiny_dir_b), weight_version=1)
    await served_stock.client.continue_generation()
    res: GenerateResult = await task
    switch = res.token_versions.index(1)
    assert res.token_versions == [0] * switch + [1] * (60 - switch)
    measured = measure_staleness(res.token_versions, current_version=1)
    assert measured.coverage == 1.0 and measured.mixed and measured.s_old == 1
    async with httpx.AsyncClient(base_url=served_stock.url) as http:
        raw = (
            await http.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}})
        ).json()
    assert raw["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": 2}]
    assert set(raw["meta_info"]) >= {"weight_version", "weight_versions"}


async def test_update_from_disk_changes_outputs_and_version(served: Served, tiny_dir_b: Path) -> None:
    prompt = _prompt("hello")
    sp = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    before = await served.client.generate(prompt, sp)
    reply = await served.client.update_weights_from_disk(str(tiny_dir_b), weight_version=5)
    assert reply.success
    after = await served.client.generate(prompt, sp)
    assert after.cached_tokens == 0  # the update flushed the prefix cache
    assert after.output_logprobs != pytest.approx(before.output_logprobs, abs=1e-4)
    assert after.token_versions == [5] * 10 and await served.client.get_weight_version() == 5
    with pytest.raises(EngineError, match=r"no \*\.safetensors"):
        await served.client.update_weights_from_disk(str(tiny_dir_b / "missing"), weight_version=6)
    assert served.engine.weight_version == 5


class _Trainer:
    """Rank 0 of a gloo weight-update group on a thread: broadcasts each queued list of tensors in order."""

    def __init__(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.jobs: queue.Queue[list[torch.Tensor] | None] = queue.Queue()
        self.done: queue.Queue[BaseException | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        group = open_weight_update_group(
            backend="gloo", master_address="127.0.0.1", master_port=self.port, rank=0, world_size=2
        )
        try:
            while (tensors := self.jobs.get()) is not None:
                try:
                    for t in tensors:
                        group.broadcast(t.contiguous(), src=0)
                    self.done.put(None)
                except BaseException as e:
                    self.done.put(e)
        finally:
            group.close()

    async def update(
        self,
        served: Served,
        named: list[tuple[str, torch.Tensor]],
        version: int,
        load_format: str | None = None,
    ) -> None:
        """The wire contract: announce names, dtypes and shapes, broadcast concurrently, in that order.

        load_format="flattened_bucket" (SGLang): one broadcast of every tensor's bytes back to back.
        """
        if load_format == "flattened_bucket":
            self.jobs.put([torch.cat([t.contiguous().flatten().view(torch.uint8) for _, t in named])])
        else:
            self.jobs.put([t for _, t in named])
        body = {
            "names": [n for n, _ in named],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "group_name": "weight_update_group",
            "weight_version": str(version),
            "load_format": load_format,
        }
        try:
            async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
                reply = (await http.post("/update_weights_from_distributed", json=body)).json()
            if not reply["success"]:
                raise EngineError("/update_weights_from_distributed", 400, reply["message"])
        finally:
            # Every broadcast completed: the engine received (or drained) all of them.
            assert await asyncio.to_thread(self.done.get, True, 60) is None

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(60)


@pytest.fixture
async def trainer(served: Served) -> AsyncIterator[_Trainer]:
    t = _Trainer()
    await served.client.init_weights_update_group(
        "127.0.0.1", t.port, rank_offset=1, world_size=2, backend="gloo"
    )
    yield t
    t.close()
    await served.client.destroy_weights_update_group()


async def test_update_from_distributed_gloo(served: Served, trainer: _Trainer, tiny_dir_b: Path) -> None:
    new = load_file(str(tiny_dir_b / "model.safetensors"))
    names = sorted(new)
    storage = {n: t.data_ptr() for n, t in served.engine.named_weights().items()}
    await trainer.update(served, [(n, new[n]) for n in names], version=2)
    live = served.engine.named_weights()
    assert all(torch.equal(live[n], new[n]) for n in names)
    # Received in place: every parameter still lives in its own storage (CUDA graphs point there).
    assert {n: t.data_ptr() for n, t in live.items()} == storage
    res = await served.client.generate(_prompt("hi"), SamplingParams(max_new_tokens=6, temperature=0.0))
    assert res.weight_version == 2 and set(res.token_versions) <= {2}


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
async def test_distributed_update_casts_a_mismatching_dtype(
    served: Served, trainer: _Trainer, tiny_dir_b: Path, load_format: str | None
) -> None:
    new = load_file(str(tiny_dir_b / "model.safetensors"))
    names = sorted(new)
    cast = names[0]  # travels as bfloat16, the model holds float32: staged, then cast-copied
    sent = [(n, new[n].bfloat16() if n == cast else new[n]) for n in names]
    assert served.engine.named_weights()[cast].dtype == torch.float32
    await trainer.update(served, sent, version=3, load_format=load_format)
    live = served.engine.named_weights()
    assert torch.equal(live[cast], new[cast].bfloat16().float())
    assert not torch.equal(live[cast], new[cast])  # the bf16 rounding shows: it went the cast path
    assert all(torch.equal(live[n], new[n]) for n in names if n != cast)
    assert await served.client.get_weight_version() == 3


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
@pytest.mark.parametrize("bad", ["unknown name", "shape"])
async def test_distributed_update_rejected_before_any_weight_changes(
    served: Served, trainer: _Trainer, tiny_dir_b: Path, bad: str, load_format: str | None
) -> None:
    new = load_file(str(tiny_dir_b / "model.safetensors"))
    names = sorted(new)
    before = {n: t.clone() for n, t in served.engine.named_weights().items()}
    sent = [(n, new[n]) for n in names]
    if bad == "unknown name":
        sent.append(("model.layers.99.mlp.up_proj.weight", torch.ones(4, 4)))
        expect = "layers.99.mlp.up_proj.weight"
    else:
        last, t = sent[-1]
        sent[-1] = (last, torch.ones(t.numel() + 1))
        expect = f"{last} has shape"
    with pytest.raises(EngineError, match=expect):
        await trainer.update(served, sent, version=4, load_format=load_format)
    # The last tensor is the bad one, yet nothing before it reached a weight; the version stays.
    live = served.engine.named_weights()
    assert all(torch.equal(live[n], before[n]) for n in live)
    assert served.engine.weight_version == 0 and await served.client.get_weight_version() == 0
    # The broadcasts were drained, so the group is still in step: a good update goes through.
    await trainer.update(served, [(n, new[n]) for n in names], version=5, load_format=load_format)
    assert all(torch.equal(served.engine.named_weights()[n], new[n]) for n in names)
    assert served.engine.weight_version == 5


async def test_update_from_tensor_needs_the_flag(
    served: Served, served_tensor: Served, tiny_dir_b: Path
) -> None:
    new = load_file(str(tiny_dir_b / "model.safetensors"))
    payload = dumps_named_tensors(sorted(new.items()))
    with pytest.raises(EngineError) as err:
        await served.client.update_weights_from_tensor([payload], weight_version=3)
    assert err.value.status == 403 and "--allow-tensor-updates" in err.value.message
    await served_tensor.client.update_weights_from_tensor([payload], weight_version=3)
    live = served_tensor.engine.named_weights()
    assert all(torch.equal(live[n], t) for n, t in new.items())
    assert await served_tensor.client.get_weight_version() == 3


async def test_abort_one_and_all(served: Served) -> None:
    sp = SamplingParams(max_new_tokens=200, temperature=1.0, ignore_eos=True)
    one = asyncio.create_task(served.client.generate(_prompt("x"), sp, rid="victim"))
    other = asyncio.create_task(served.client.generate(_prompt("y"), SamplingParams(max_new_tokens=5)))
    await _wait_tokens(served, 2)
    await served.client.abort("victim")
    res = await one
    assert res.finish_reason == "abort" and len(res.output_ids) < 200
    assert (await other).finish_reason in ("stop", "length")
    rest = [asyncio.create_task(served.client.generate(_prompt(str(i)), sp)) for i in range(3)]
    await _wait_tokens(served, served.engine.stats.generated_tokens + 3)
    await served.client.abort()
    assert {r.finish_reason for r in await asyncio.gather(*rest)} == {"abort"}


async def test_pause_abort_mode_and_in_place(served: Served) -> None:
    sp = SamplingParams(max_new_tokens=150, temperature=1.0, ignore_eos=True)
    task = asyncio.create_task(served.client.generate(_prompt("z"), sp))
    await _wait_tokens(served, 2)
    await served.client.pause_generation("in_place")
    await asyncio.wait_for(served.client.health_generate(), 30)  # a probe never waits on a pause
    queued = asyncio.create_task(served.client.generate(_prompt("w"), SamplingParams(max_new_tokens=3)))
    await served.client.continue_generation()
    assert len((await task).output_ids) == 150 and (await queued).finish_reason in ("stop", "length")
    task = asyncio.create_task(served.client.generate(_prompt("z"), sp))
    await _wait_tokens(served, served.engine.stats.generated_tokens + 2)
    await served.client.pause_generation("abort")
    assert (await task).finish_reason == "abort"
    await served.client.continue_generation()


async def test_health_model_info_and_versions(served: Served) -> None:
    assert await served.client.health()
    await served.client.health_generate()
    info = await served.client.model_info()
    assert info.weight_version == "0" and info.model_type == "qwen3"
    await served.client.update_weight_version(9)
    assert await served.client.get_weight_version() == 9


async def test_prompt_logprobs_for_scoring(served: Served, tiny_dir: Path) -> None:
    """OPD-style scoring: max_new_tokens 0 and logprob_start_len 0 give every prompt token's logprob."""
    prompt = _prompt("score me")
    await served.client.generate(prompt, SamplingParams(max_new_tokens=2))  # warm the prefix cache
    # Prompt logprobs ignore the temperature (SGLang's default): scored from the raw logits.
    sp = SamplingParams(max_new_tokens=0, temperature=0.5)
    res = await served.client.generate(prompt, sp, logprob_start_len=0)
    assert res.output_ids == [] and res.input_logprobs is not None and res.input_logprobs[0] is None
    ref = _reference_logprobs(tiny_dir, prompt[:1], prompt[1:], 1.0)
    assert res.input_logprobs[1:] == pytest.approx(ref, abs=1e-5)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input_ids": [1, 2, 999], "sampling_params": {}}, "input_ids contains 999"),
        ({"input_ids": [1, 2], "sampling_params": {"stop": ["x"]}}, "stop_token_ids"),
        ({"input_ids": [1, 2], "sampling_params": {"temprature": 1.0}}, "temprature"),
        ({"input_ids": [], "sampling_params": {}}, "input_ids is empty"),
        ({"input_ids": [1] * 300, "sampling_params": {}}, "context length"),
        ({"input_ids": [1, 2], "routed_dp_rank": 1}, "routed_dp_rank=1"),
        ({"input_ids": [1, 2], "routed_dp_rank": -1}, "routed_dp_rank"),
    ],
)
async def test_bad_requests_name_the_field(served: Served, body: dict[str, object], needle: str) -> None:
    resp = await _post(served.url + "/generate", body)
    assert resp.status_code == 400
    assert needle in resp.json()["error"]


def test_load_weights_api_rejects_bad_tensors(tiny_dir: Path) -> None:
    engine = ReferenceEngine.load(tiny_dir, max_running_requests=2, context_length=32)
    w = engine.named_weights()
    assert "model.embed_tokens.weight" in w and engine.device == torch.device("cpu")
    with pytest.raises(KeyError, match="not a parameter"):
        engine.load_weights([("model.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="dtype"):
        engine.load_weights(
            [("model.norm.weight", torch.zeros_like(w["model.norm.weight"], dtype=torch.float64))]
        )
    assert engine.load_weights([("model.norm.weight", torch.full_like(w["model.norm.weight"], 2.0))]) == 1
    assert bool((engine.named_weights()["model.norm.weight"] == 2.0).all())


async def test_batch_request_returns_one_reply_per_prompt(served: Served) -> None:
    body = {
        "input_ids": [_prompt("a"), _prompt("bb")],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
        "rid": "grp",
    }
    resp = await _post(served.url + "/generate", body)
    replies = [GenerateReply.model_validate(r) for r in resp.json()]
    assert [r.meta_info.id for r in replies] == ["grp-0", "grp-1"]
    assert [len(r.output_ids) for r in replies] == [3, 3]
    assert all(len(r.meta_info.output_token_logprobs or []) == 3 for r in replies)


async def test_routed_dp_rank_zero_is_the_single_rank(served: Served) -> None:
    body = {"input_ids": _prompt("a"), "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    plain = await _post(served.url + "/generate", body)
    routed = await _post(served.url + "/generate", {**body, "routed_dp_rank": 0})
    assert routed.status_code == 200, routed.text
    assert routed.json()["output_ids"] == plain.json()["output_ids"]


async def test_distributed_update_unknown_load_format_is_refused(served: Served, trainer: _Trainer) -> None:
    body = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[2, 2]], "load_format": "npz"}
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
        reply = (await http.post("/update_weights_from_distributed", json=body)).json()
    assert reply["success"] is False and "load_format 'npz' is not supported" in reply["message"]


async def test_engine_stats_count_turns_per_session_key(served: Served) -> None:
    """Each /generate carrying the session server's X-SMG-Routing-Key counts one turn of that session
    (what e2e/test_realpods_affinity.py reads from the engine pods); requests without it count none."""
    sp = SamplingParams(max_new_tokens=2, temperature=0.0)
    for key in ("s1", "s2", "s1", None):
        await served.client.generate(_prompt("a"), sp, headers={"X-SMG-Routing-Key": key} if key else None)
    async with httpx.AsyncClient(timeout=60) as http:
        stats = (await http.get(served.url + "/engine_stats")).json()
    assert stats["session_turns"] == {"s1": 2, "s2": 1} and stats["requests"] == 4


def test_session_turns_keep_the_most_recent_keys() -> None:
    from lockstep.engine.requests import SESSION_KEYS_KEPT, EngineStats

    stats = EngineStats()
    for i in range(SESSION_KEYS_KEPT + 1):
        stats.count_turn(f"s{i}")
    stats.count_turn("s1")  # a turn refreshes its key: the oldest other one goes next
    stats.count_turn("new")
    assert len(stats.session_turns) == SESSION_KEYS_KEPT
    assert "s0" not in stats.session_turns and "s2" not in stats.session_turns
    assert stats.session_turns["s1"] == 2 and stats.session_turns["new"] == 1


def test_a_session_key_over_the_cap_is_not_counted() -> None:
    from lockstep.engine.requests import SESSION_KEY_MAX_CHARS, EngineStats

    stats = EngineStats()
    stats.count_turn("k" * SESSION_KEY_MAX_CHARS)
    stats.count_turn("k" * (SESSION_KEY_MAX_CHARS + 1))  # a client's 8 KB header would be kept 4096 times
    assert (
        list(stats.session_turns.values()) == [1]
        and len(next(iter(stats.session_turns))) == SESSION_KEY_MAX_CHARS
    )
