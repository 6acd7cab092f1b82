"""R3 figure: how much routing replay shrinks the train-rollout logprob gap when routes flip.

Why it exists: R3 (§4.1) fixes MoE expert membership, not gate values or the arithmetic inside
experts. This measures both halves on the tiny Qwen3-MoE model: a real reference engine over HTTP
generates with its routers perturbed by Gaussian noise of a given std (standing in for a different
kernel, dtype or weight copy), then the FSDP trainer scores the same tokens with replay off and on.
It prints, per noise level, the routing mismatch (share of (token, MoE layer) pairs whose trainer
top-k differs from the rollout's), the share of pairs whose experts the trainer actually used equal
the rollout's, the mean |train - rollout| logprob gap off and on, and the ratio on/off (the baseline
is replay off, measured in the same run).

Run: `.venv/bin/python bench/r3_replay.py [--noise 0 0.005 0.01 0.02] [--samples 8] [--tokens 12]`.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

import torch
from aiohttp.test_utils import TestServer
from lockstep.engine import ReferenceEngine, create_app
from lockstep.models.moe import routing_shape
from lockstep.models.tiny import materialize_builtin
from lockstep.serving import EngineClient, SamplingParams
from lockstep.train.common.batch import TrainBatch
from lockstep.train.common.packing import pack_groups
from lockstep.train.common.r3 import build_replay, collate_routed_experts
from lockstep.train.fsdp import FSDPBackend, FSDPConfig
from lockstep.types import Group, Sample

PROMPT = [2, 20, 21, 22, 23, 3]


async def rollout(path: Path, noise: float, samples: int, tokens: int) -> TrainBatch:
    """One group from a real engine whose routers carry N(0, noise^2) perturbations; packed with R3 data."""
    engine = ReferenceEngine.load(path, max_running_requests=samples, context_length=128, seed=0)
    gen = torch.Generator().manual_seed(0)
    engine.load_weights(
        (name, w + noise * torch.randn(w.shape, generator=gen))
        for name, w in engine.named_weights().items()
        if name.endswith("mlp.gate.weight")
    )
    server = TestServer(create_app(engine), host="127.0.0.1")
    await server.start_server()
    client = EngineClient(str(server.make_url("")).rstrip("/"), retries=2, backoff_s=0.01)
    params = [
        SamplingParams(max_new_tokens=tokens, temperature=1.0, ignore_eos=True, sampling_seed=i)
        for i in range(samples)
    ]
    try:
        results = await asyncio.gather(
            *(client.generate(PROMPT, p, return_routed_experts=True) for p in params)
        )
    finally:
        await client.aclose()
        await server.close()
    group = Group(
        index=0,
        samples=[
            Sample(
                group_index=0,
                index=i,
                prompt_ids=list(PROMPT),
                response_ids=list(r.output_ids),
                loss_mask=[1] * len(r.output_ids),
                rollout_logprobs=list(r.output_logprobs),
                token_versions=[0] * len(r.output_ids),
                reward=float(i % 2),
                routed_experts=r.routed_experts,
            )
            for i, r in enumerate(results)
        ],
    )
    batch = pack_groups([group])
    batch.routed_experts = collate_routed_experts([group])
    return batch


def score(path: Path, batch: TrainBatch, replay: bool) -> tuple[float, float, float]:
    """(routing mismatch, share of pairs whose USED experts equal the rollout's, mean |logprob gap|)."""
    shape = routing_shape(path)
    assert shape is not None
    backend = FSDPBackend(FSDPConfig(model_path=path, micro_batch_size=2, device="cpu", r3_replay=replay))
    seen: dict[int, list[torch.Tensor]] = {}
    handles = []
    for li, layer in enumerate(backend.model.model.layers):

        def pre(_mod: Any, args: Any, li: int = li) -> None:
            seen.setdefault(li, []).append(args[1].detach().clone())  # top_k_index [N, k]

        handles.append(layer.mlp.experts.register_forward_pre_hook(pre))
    try:
        lp = backend.compute_logprobs(batch)  # [B, T-1]
        mismatch = float(backend.last_routing.mismatch)
    finally:
        for h in handles:
            h.remove()
        backend.close()
    plan = build_replay(
        batch.routed_experts,
        batch.attention_mask,
        num_layers=shape.num_layers,
        top_k=shape.top_k,
        num_experts=shape.num_experts,
    )
    assert plan is not None
    t = batch.input_ids.shape[1]
    equal = total = 0
    for li, calls in seen.items():
        used = torch.cat([c.view(-1, t, shape.top_k) for c in calls])[:, :-1]  # [B, T-1, k]
        same = (used == plan.indices[:, :, li]).all(-1)[plan.valid]
        equal, total = equal + int(same.sum()), total + int(same.numel())
    m = batch.loss_mask > 0
    gap = float((lp - batch.rollout_logprobs)[m].abs().mean())
    return mismatch, equal / total, gap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.005, 0.01, 0.02])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=12)
    args = ap.parse_args()
    path = materialize_builtin("builtin:tiny-moe", Path(tempfile.mkdtemp()), seed=0)
    print(
        "| router noise std | routing mismatch | experts used = rollout's, off / on | gap off | gap on | on/off |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for noise in args.noise:
        batch = asyncio.run(rollout(path, noise, args.samples, args.tokens))
        mis_off, used_off, gap_off = score(path, batch, replay=False)
        _, used_on, gap_on = score(path, batch, replay=True)
        ratio = gap_on / gap_off if gap_off > 0 else float("nan")
        print(
            f"| {noise:g} | {mis_off:.3f} | {used_off:.3f} / {used_on:.3f} | {gap_off:.2e} | {gap_on:.2e} | {ratio:.3f} |"
        )


if __name__ == "__main__":
    main()
