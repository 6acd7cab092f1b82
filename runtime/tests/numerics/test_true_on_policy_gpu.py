"""True on-policy on CUDA: the engine's and the trainer's logprobs are bit-identical on the GPU.

The Qwen3 dense profile at the Qwen3-0.6B shape (builtin:bigger: hidden 1024, 28 layers, GQA 16/8,
head 128, vocab 151936; random init, bf16 on both sides) and the tiny profile. The reference engine
decodes with its CUDA graphs and continuous batching at two batch sizes; the FSDP2 backend (NCCL,
one rank) scores the same tokens in micro-batches of another size, rows shuffled. Exact kernels on
both sides: every sampled token's difference is exactly 0.0; mode off: not zero.

Run on the GPU machine: `pytest runtime/tests/numerics/test_true_on_policy_gpu.py -m gpu -q`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from lockstep.engine import ReferenceEngine
from lockstep.models.tiny import materialize_builtin
from lockstep.serving import SamplingParams
from lockstep.train.common.batch import TrainBatch
from lockstep.train.common.packing import pack_groups
from lockstep.train.fsdp import FSDPBackend, FSDPConfig
from lockstep.types import Group, Sample

pytestmark = pytest.mark.gpu

NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["tiny", "bigger"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = materialize_builtin(
        f"builtin:{request.param}", tmp_path_factory.mktemp(request.param), seed=0
    )
    return path


def _prompts(vocab_hi: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(6, vocab_hi, (n,), generator=gen).tolist() for n in (5, 17, 33, 9, 2, 24)]


async def _generate(engine: ReferenceEngine, prompts: list[list[int]]) -> list[Sample]:
    await engine.start()
    try:
        seqs = await asyncio.wait_for(
            asyncio.gather(
                *(
                    engine.submit(
                        engine.new_sequence(
                            p, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, sampling_seed=i)
                        )
                    )
                    for i, p in enumerate(prompts)
                )
            ),
            600,
        )
    finally:
        await engine.close()
    return [
        Sample(
            group_index=i // 2,
            index=i % 2,
            prompt_ids=list(p),
            response_ids=list(s.output_ids),
            loss_mask=[1] * len(s.output_ids),
            rollout_logprobs=list(s.logprobs),
            token_versions=[0] * len(s.output_ids),
            reward=float(i % 2),
        )
        for i, (p, s) in enumerate(zip(prompts, seqs, strict=True))
    ]


def _rollout(path: Path, exact: bool, slots: int) -> TrainBatch:
    engine = ReferenceEngine.load(
        path, device="cuda", dtype=torch.bfloat16, max_running_requests=slots, context_length=128,
        true_on_policy=exact,
    )  # fmt: skip
    samples = asyncio.run(_generate(engine, _prompts(min(engine.vocab_size, 4000))))
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    return pack_groups([Group(index=i, samples=g) for i, g in groups.items()])


def _max_diff(path: Path, batch: TrainBatch, exact: bool, micro: int) -> float:
    backend = FSDPBackend(
        FSDPConfig(
            model_path=path, device="cuda", dtype="bfloat16", micro_batch_size=micro, true_on_policy=exact
        )
    )
    perm = torch.randperm(batch.size, generator=torch.Generator().manual_seed(micro)).tolist()
    rows = TrainBatch(
        input_ids=batch.input_ids[perm],
        attention_mask=batch.attention_mask[perm],
        loss_mask=batch.loss_mask[perm],
        rollout_logprobs=batch.rollout_logprobs[perm],
        advantages=batch.advantages[perm],
    )
    try:
        train = backend.compute_logprobs(rows)
    finally:
        backend.close()
    mask = rows.loss_mask > 0
    assert int(mask.sum()) == 6 * NEW_TOKENS
    return float((train - rows.rollout_logprobs)[mask].abs().max())


@pytest.mark.parametrize(("slots", "micro"), [(8, 4), (2, 3)])
def test_exact_zero_on_cuda(model_dir: Path, slots: int, micro: int) -> None:
    assert _max_diff(model_dir, _rollout(model_dir, True, slots), True, micro) == 0.0


def test_mode_off_is_not_exact_on_cuda(model_dir: Path) -> None:
    if model_dir.name.startswith("tiny"):
        # Seen on an H200 (2026-12-03): the tiny shapes are too small for cuBLAS to pick a different
        # reduction order per batch, so even the default kernels agree; the Qwen3-0.6B shape shows it.
        pytest.skip("tiny shapes agree on CUDA even without the exact kernels; the bigger profile fails here")
    assert _max_diff(model_dir, _rollout(model_dir, False, 8), False, 4) > 0.0
