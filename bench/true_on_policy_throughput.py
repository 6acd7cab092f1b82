"""Throughput cost of true on-policy: rollout tokens/s and trainer scoring tokens/s, exact vs default.

Why it exists: §4.3 says determinism and batch invariance give up throughput
optimizations, and the cost must be measured, not guessed. Both sides are timed in the same run on
the same machine, with the batch-invariant kernels (lockstep.numerics.exact) and with the default
path, and the ratio exact / default is printed (below 1: the price of the guarantee). The measured
train-rollout logprob max |diff| of each mode is printed too (exact: 0.0).

Setup: the reference engine in this process generates PROMPTS sequences of NEW tokens each
(continuous batching over --slots), then the FSDP2 backend (one rank) scores the same tokens
(compute_logprobs, micro-batch --micro). Model: builtin:tiny on CPU (default), builtin:bigger
(Qwen3-0.6B shape, bf16) with --device cuda.

Run (CPU):   .venv/bin/python bench/true_on_policy_throughput.py
Run (H200):  .venv/bin/python bench/true_on_policy_throughput.py --device cuda --model builtin:bigger \
               --prompts 64 --new 128 --slots 64 --micro 16
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch
from lockstep.engine import ReferenceEngine
from lockstep.models.tiny import materialize_builtin
from lockstep.serving import SamplingParams
from lockstep.train.common.packing import pack_groups
from lockstep.train.fsdp import FSDPBackend, FSDPConfig
from lockstep.types import Group, Sample


def _prompts(n: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(6, min(vocab, 90), (int(n_tok),), generator=gen).tolist()
            for n_tok in torch.randint(4, 24, (n,), generator=gen)]  # fmt: skip


async def _generate(
    engine: ReferenceEngine, prompts: list[list[int]], new: int
) -> list[tuple[list[int], list[int], list[float]]]:
    await engine.start()
    try:
        seqs = await asyncio.gather(*(engine.submit(engine.new_sequence(
            p, SamplingParams(max_new_tokens=new, ignore_eos=True, sampling_seed=i))) for i, p in enumerate(prompts)))  # fmt: skip
    finally:
        await engine.close()
    return [(p, list(s.output_ids), list(s.logprobs)) for p, s in zip(prompts, seqs, strict=True)]


def measure(path: Path, args: argparse.Namespace, exact: bool) -> dict[str, float]:
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    engine = ReferenceEngine.load(path, device=args.device, dtype=dtype, max_running_requests=args.slots,
                                  context_length=256, true_on_policy=exact)  # fmt: skip
    prompts = _prompts(args.prompts, engine.vocab_size)
    asyncio.run(_generate(engine, prompts[: min(4, len(prompts))], 4))  # warm-up (graphs, lazy inits)
    engine = ReferenceEngine.load(path, device=args.device, dtype=dtype, max_running_requests=args.slots,
                                  context_length=256, true_on_policy=exact)  # fmt: skip
    t0 = time.perf_counter()
    out = asyncio.run(_generate(engine, prompts, args.new))
    gen_s = time.perf_counter() - t0
    samples = [Sample(group_index=i, index=0, prompt_ids=p, response_ids=r, loss_mask=[1] * len(r),
                      rollout_logprobs=lp, token_versions=[0] * len(r), reward=0.0)
               for i, (p, r, lp) in enumerate(out)]  # fmt: skip
    batch = pack_groups([Group(index=s.group_index, samples=[s]) for s in samples])
    backend = FSDPBackend(FSDPConfig(model_path=path, device=args.device, micro_batch_size=args.micro,
                                     dtype="bfloat16" if args.device == "cuda" else "float32", true_on_policy=exact))  # fmt: skip
    try:
        backend.compute_logprobs(batch.rows(0, min(args.micro, batch.size)))  # warm-up
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        train = backend.compute_logprobs(batch)
        if args.device == "cuda":
            torch.cuda.synchronize()
        score_s = time.perf_counter() - t0
    finally:
        backend.close()
    tokens = float(batch.loss_mask.sum())
    mask = batch.loss_mask > 0
    return {"rollout_tok_s": tokens / gen_s, "score_tok_s": tokens / score_s,
            "max_abs_diff": float((train - batch.rollout_logprobs)[mask].abs().max())}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--model", default=None, help="builtin:tiny (cpu default) or builtin:bigger (cuda default)"
    )
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new", type=int, default=24, help="tokens generated per prompt")
    p.add_argument("--slots", type=int, default=16, help="engine KV slots (decode batch)")
    p.add_argument("--micro", type=int, default=8, help="trainer micro-batch rows")
    args = p.parse_args()
    model = args.model or ("builtin:bigger" if args.device == "cuda" else "builtin:tiny")
    with tempfile.TemporaryDirectory() as tmp:
        path = materialize_builtin(model, Path(tmp) / "m", seed=0)
        base = measure(path, args, exact=False)
        top = measure(path, args, exact=True)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"true on-policy throughput, {model} on {name} ({args.prompts} prompts x {args.new} tokens, "
          f"{args.slots} slots, micro-batch {args.micro})")  # fmt: skip
    print(f"{'':10} {'rollout tok/s':>14} {'score tok/s':>12} {'max |diff|':>11}")
    for label, m in (("default", base), ("exact", top)):
        print(f"{label:10} {m['rollout_tok_s']:14.1f} {m['score_tok_s']:12.1f} {m['max_abs_diff']:11.3g}")
    print(f"ratio exact/default: rollout {top['rollout_tok_s'] / base['rollout_tok_s']:.3f}, "
          f"scoring {top['score_tok_s'] / base['score_tok_s']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
