"""R3 end to end: real engine rollouts of builtin:tiny-moe, replayed by the FSDP2 backend (gloo, 1 rank).

The engine's routers are perturbed slightly (as a different kernel or dtype would), so some of the
trainer's own top-k choices differ from the rollout's. Without replay the trainer reports
r3_routing_mismatch > 0 and its experts differ from the rollout's; with replay the experts its MoE
blocks actually receive (captured by a hook on the experts modules, independent of the replay hook)
equal the rollout's exactly, the train-rollout logprob gap shrinks, and the router still trains
(gate values are the trainer's own scores). A malformed payload is a clear error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestServer
from lockstep.engine import ReferenceEngine, create_app
from lockstep.models.tiny import materialize_builtin
from lockstep.serving import EngineClient, SamplingParams
from lockstep.train.common.batch import TrainBatch
from lockstep.train.common.losses import PolicyLossConfig, make_policy_loss
from lockstep.train.common.packing import pack_groups
from lockstep.train.common.r3 import R3PayloadError, build_replay, collate_routed_experts
from lockstep.train.fsdp import FSDPBackend, FSDPConfig
from lockstep.types import Group, Sample

NOISE = 0.01
"""Std of the noise added to the engine's router weights (the routers' own std is ~0.02)."""


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = materialize_builtin("builtin:tiny-moe", tmp_path_factory.mktemp("tinymoe"), seed=0)
    return path


async def _rollout(path: Path) -> TrainBatch:
    """One group of 4 samples from a real engine over HTTP, with routers perturbed; packed for training."""
    engine = ReferenceEngine.load(path, max_running_requests=8, context_length=128, seed=0)
    gen = torch.Generator().manual_seed(0)
    engine.load_weights(
        (name, w + NOISE * torch.randn(w.shape, generator=gen))
        for name, w in engine.named_weights().items()
        if name.endswith("mlp.gate.weight")
    )
    server = TestServer(create_app(engine), host="127.0.0.1")
    await server.start_server()
    client = EngineClient(str(server.make_url("")).rstrip("/"), retries=2, backoff_s=0.01)
    prompt = [2, 20, 21, 22, 23, 3]
    try:
        results = await asyncio.gather(
            *(
                client.generate(
                    prompt,
                    SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True, sampling_seed=i),
                    return_routed_experts=True,
                )
                for i in range(4)
            )
        )
    finally:
        await client.aclose()
        await server.close()
    samples = [
        Sample(
            group_index=0,
            index=i,
            prompt_ids=list(prompt),
            response_ids=list(res.output_ids),
            loss_mask=[1] * len(res.output_ids),
            rollout_logprobs=list(res.output_logprobs),
            token_versions=[0] * len(res.output_ids),
            reward=float(i % 2),
            routed_experts=res.routed_experts,
        )
        for i, res in enumerate(results)
    ]
    groups = [Group(index=0, samples=samples)]
    batch = pack_groups(groups)
    batch.routed_experts = collate_routed_experts(groups)
    return batch


@pytest.fixture(scope="module")
def batch(moe_dir: Path) -> TrainBatch:
    return asyncio.run(_rollout(moe_dir))


@pytest.fixture
def make_backend(moe_dir: Path) -> Iterator[Any]:
    made: list[FSDPBackend] = []

    def make(replay: bool) -> FSDPBackend:
        b = FSDPBackend(
            FSDPConfig(model_path=moe_dir, lr=1e-2, micro_batch_size=2, device="cpu", r3_replay=replay)
        )
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def _capture_experts(model: Any) -> tuple[dict[int, list[torch.Tensor]], list[Any]]:
    """Record the expert IDs each MoE block's experts module is called with (per layer, per call)."""
    seen: dict[int, list[torch.Tensor]] = {}
    handles = []
    for li, layer in enumerate(model.model.layers):

        def pre(_mod: Any, args: Any, li: int = li) -> None:
            seen.setdefault(li, []).append(args[1].detach().clone())  # top_k_index [N, k]

        handles.append(layer.mlp.experts.register_forward_pre_hook(pre))
    return seen, handles


def _used_vs_rollout(backend: FSDPBackend, batch: TrainBatch) -> tuple[torch.Tensor, float]:
    """compute_logprobs while capturing the experts used; returns (logprobs, share of covered
    (token, layer) pairs whose experts equal the rollout's, in order)."""
    seen, handles = _capture_experts(backend.model)
    try:
        lp = backend.compute_logprobs(batch)
    finally:
        for h in handles:
            h.remove()
    plan = build_replay(batch.routed_experts, batch.attention_mask, num_layers=2, top_k=2, num_experts=8)
    assert plan is not None
    t = batch.input_ids.shape[1]
    equal, total = 0, 0
    for li, calls in seen.items():
        used = torch.cat([c.view(-1, t, 2) for c in calls])[:, :-1]  # micro-batches -> [B, T-1, k]
        same = (used == plan.indices[:, :, li]).all(-1)[plan.valid]
        equal += int(same.sum())
        total += int(same.numel())
    return lp, equal / total


def _gap(lp: torch.Tensor, batch: TrainBatch) -> float:
    m = batch.loss_mask > 0
    return float((lp - batch.rollout_logprobs)[m].abs().mean())


def test_replay_uses_the_rollout_experts_and_shrinks_the_gap(make_backend: Any, batch: TrainBatch) -> None:
    loss = make_policy_loss(PolicyLossConfig())
    off = make_backend(replay=False)
    lp_off, agree_off = _used_vs_rollout(off, batch)
    step_off = off.train_step(replace(batch, old_logprobs=lp_off), loss)
    off.close()
    assert step_off.metrics["r3_routing_mismatch"] > 0.05  # routes flipped: R3 has work to do
    assert step_off.metrics["r3_payload_bytes"] == sum(len(p) for p in batch.routed_experts if p)
    assert agree_off < 1.0

    on = make_backend(replay=True)
    lp_on, agree_on = _used_vs_rollout(on, batch)
    assert agree_on == 1.0  # every covered (token, layer) went through exactly the rollout's experts
    assert _gap(lp_on, batch) < 0.5 * _gap(lp_off, batch)
    router = on.model.model.layers[0].mlp.gate.weight
    before = router.full_tensor().detach().clone()
    step_on = on.train_step(replace(batch, old_logprobs=lp_on), loss)
    # Replay on still reports what the trainer would have chosen.
    assert step_on.metrics["r3_routing_mismatch"] > 0.05 and not step_on.skipped
    assert not torch.equal(router.full_tensor().detach(), before)  # gate values are trained, not replayed


def test_malformed_payload_is_a_clear_error(make_backend: Any, batch: TrainBatch) -> None:
    payloads = list(batch.routed_experts)
    payloads[3] = payloads[3][:-16] if payloads[3] else None  # one token row short
    n = int(batch.attention_mask[3].sum())
    backend = make_backend(replay=True)
    with pytest.raises(R3PayloadError, match=rf"sample row 3: .*expected int32 \[{n - 1}, 2, 2\]"):
        backend.compute_logprobs(replace(batch, routed_experts=payloads))
