"""True on-policy on the tiny profile (dense and MoE): the engine's and the trainer's logprobs are bit-identical.

Real components: the reference engine behind its HTTP app (continuous batching, prefix cache, a KV
cache, one decode token per sequence) samples; the FSDP2 backend (gloo, one CPU rank) scores the same
tokens in padded micro-batches. With the exact kernels on both sides the difference is exactly 0.0
for every sampled token, whatever the engine's batch size, the order requests arrive in, and the
trainer's micro-batch size and row order. With the mode off the same comparison is not zero, so the
test can fail.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from aiohttp.test_utils import TestServer
from lockstep.engine import ReferenceEngine, create_app
from lockstep.models.loading import load_causal_lm
from lockstep.models.tiny import materialize_builtin
from lockstep.numerics import exact as exact_kernels
from lockstep.serving import EngineClient, SamplingParams
from lockstep.train.common.batch import TrainBatch
from lockstep.train.common.packing import pack_groups
from lockstep.train.fsdp import FSDPBackend, FSDPConfig
from lockstep.types import Group, Sample
from transformers import AutoModelForCausalLM

PROMPTS = [[2, 20, 21, 22, 3], [2, 30, 3], [2, 40, 41, 42, 43, 44, 45, 46, 3], [2, 11, 12, 3]]


@pytest.fixture(scope="module", params=["builtin:tiny", "builtin:tiny-moe"])
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """The tiny profile, dense and MoE (router and experts on the same kernels: lockstep.numerics.experts)."""
    path: Path = materialize_builtin(request.param, tmp_path_factory.mktemp("tiny"), seed=0)
    return path


async def _rollout(
    path: Path, *, exact: bool, slots: int, order: list[int], temperature: float
) -> list[Sample]:
    """Two samples per prompt from a real engine over HTTP, submitted together in `order`."""
    engine = ReferenceEngine.load(
        path, max_running_requests=slots, context_length=128, seed=0, true_on_policy=exact
    )
    server = TestServer(create_app(engine), host="127.0.0.1")
    await server.start_server()
    client = EngineClient(str(server.make_url("")).rstrip("/"), retries=2, backoff_s=0.01)
    jobs = [(p, s) for p in order for s in range(2)]
    try:
        results = await asyncio.gather(
            *(
                client.generate(
                    PROMPTS[p],
                    SamplingParams(
                        max_new_tokens=10, temperature=temperature, ignore_eos=True, sampling_seed=10 * p + s
                    ),
                )
                for p, s in jobs
            )
        )
    finally:
        await client.aclose()
        await server.close()
    return [
        Sample(
            group_index=p,
            index=s,
            prompt_ids=list(PROMPTS[p]),
            response_ids=list(r.output_ids),
            loss_mask=[1] * len(r.output_ids),
            rollout_logprobs=list(r.output_logprobs),
            token_versions=[0] * len(r.output_ids),
            reward=float(s),
        )
        for (p, s), r in zip(jobs, results, strict=True)
    ]


def _batch(samples: list[Sample], temperature: float) -> TrainBatch:
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    return pack_groups([Group(index=i, samples=g) for i, g in groups.items()], temperature=temperature)


def _max_diff(path: Path, batch: TrainBatch, *, exact: bool, micro: int, perm: list[int]) -> float:
    backend = FSDPBackend(
        FSDPConfig(model_path=path, micro_batch_size=micro, device="cpu", true_on_policy=exact)
    )
    try:
        rows = TrainBatch(
            input_ids=batch.input_ids[perm],
            attention_mask=batch.attention_mask[perm],
            loss_mask=batch.loss_mask[perm],
            rollout_logprobs=batch.rollout_logprobs[perm],
            advantages=batch.advantages[perm],
            temperature=batch.temperature,
        )
        train = backend.compute_logprobs(rows)
    finally:
        backend.close()
    mask = rows.loss_mask > 0
    assert int(mask.sum()) == 8 * 10  # every sampled token is compared
    return float((train - rows.rollout_logprobs)[mask].abs().max())


@pytest.mark.parametrize(
    ("slots", "order", "micro", "temperature"),
    [
        pytest.param(8, [0, 1, 2, 3], 64, 1.0, id="all-together"),
        pytest.param(1, [3, 2, 1, 0], 1, 1.0, id="one-at-a-time"),
        pytest.param(3, [2, 0, 3, 1], 3, 0.7, id="odd-batches-temperature"),
    ],
)
def test_exact_zero_on_every_sampled_token(
    tiny_dir: Path, slots: int, order: list[int], micro: int, temperature: float
) -> None:
    samples = asyncio.run(_rollout(tiny_dir, exact=True, slots=slots, order=order, temperature=temperature))
    batch = _batch(samples, temperature)
    perm = torch.randperm(batch.size, generator=torch.Generator().manual_seed(slots)).tolist()
    assert _max_diff(tiny_dir, batch, exact=True, micro=micro, perm=perm) == 0.0


def test_rollouts_agree_across_batch_sizes(tiny_dir: Path) -> None:
    """The engine alone: the same seeded requests give the same tokens and logprobs at any batch size."""
    a = asyncio.run(_rollout(tiny_dir, exact=True, slots=8, order=[0, 1, 2, 3], temperature=1.0))
    b = asyncio.run(_rollout(tiny_dir, exact=True, slots=1, order=[0, 1, 2, 3], temperature=1.0))
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.rollout_logprobs for s in a] == [s.rollout_logprobs for s in b]


def test_mode_off_is_not_exact(tiny_dir: Path) -> None:
    """Without the kernels the same comparison differs (so the tests above can fail)."""
    samples = asyncio.run(_rollout(tiny_dir, exact=False, slots=8, order=[0, 1, 2, 3], temperature=1.0))
    batch = _batch(samples, 1.0)
    assert _max_diff(tiny_dir, batch, exact=False, micro=64, perm=list(range(batch.size))) > 0.0


def test_hub_kernels_cannot_replace_the_installed_kernels(tiny_dir: Path) -> None:
    """transformers >= 5.25 loads a model kernelized by default and kernelizes it again on every
    `.train()` / `.eval()`: without `exact.release_hub_kernels` the trainer's RMSNorm and SiLU went
    back to stock there, and `lockstep run` measured a 6e-8 train-rollout diff instead of 0."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)  # transformers' defaults, as a user loads it
    exact_kernels.apply(model, "cpu")
    installed = {name: vars(m)["forward"] for name, m in model.named_modules() if "forward" in vars(m)}
    assert any(name.endswith("input_layernorm") for name in installed)
    model.train()
    model.eval()
    assert {
        name: vars(m).get("forward") for name, m in model.named_modules() if name in installed
    } == installed


def test_checkpoints_load_without_hub_kernels(tiny_dir: Path) -> None:
    """Nothing is fetched from the kernels hub at run time, and no forward is swapped behind our back."""
    assert not getattr(load_causal_lm(tiny_dir), "use_kernels", False)
