"""Trainer scoring throughput of the two true-on-policy kernel sets vs the default path (CUDA).

Why it exists: trainer kernels `sglang` (lockstep.numerics.sglang_kernels) make the trainer compute as
stock SGLang's on-policy path does: SGLang's batch-invariant Triton matmul / mean / log_softmax, a
float32 residual stream and float32 norms. The cost must be measured. This times the trainer's HF
forward plus the sampled-token logprobs (what compute_logprobs runs per micro-batch), no grad, on a
Qwen3-0.6B-shaped model (random bf16 weights), for:

- default: transformers' bf16 forward, SDPA attention, cuBLAS, torch's log_softmax;
- sglang:  trainer kernels `sglang` with SGLang's own ops from the pinned wheel (sglang_source);
           attention is SDPA here too (FA3 does not run on the lent machine), so the figure is the
           cost of everything but attention;
- lockstep: the reference engine's exact kernels (lockstep.numerics.exact, their own attention).

Prints tokens/s per mode and the ratio to default (below 1: the price of the guarantee).

Run (H200): python3 bench/sglang_kernels_scoring.py   (LOCKSTEP_SGLANG_SOURCE where sglang is not installed)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lockstep.models.tiny import bigger_config
from lockstep.numerics import exact, kernels, sglang_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime" / "tests" / "numerics"))
import sglang_source  # (the oracle loader of SGLang's ops, shared with the GPU tests)
from sglang_reference import qwen3_model


def _score(model: Any, ids: torch.Tensor, mode: str) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
    nxt = ids[:, 1:].reshape(-1)
    temp = torch.full((nxt.numel(),), 0.7, dtype=torch.float32, device=ids.device)
    if mode == "sglang":
        return sglang_kernels.token_logprobs(flat, nxt, temp)
    if mode == "lockstep":
        return kernels.token_logprobs(flat, nxt, temp, exact.tiles_for("cuda"))
    scaled = flat.float() / temp[:, None]
    return scaled.gather(-1, nxt[:, None])[:, 0] - torch.logsumexp(scaled, dim=-1)


def _tok_per_s(mode: str, args: argparse.Namespace, ops: Any) -> float:
    model = qwen3_model(bigger_config(num_hidden_layers=args.layers), "cuda")
    if mode == "sglang":
        ops.enable_batch_invariant_mode(enable_bmm=False)
        sglang_kernels.apply(model, "cuda", ops=ops, attention="sdpa")
    elif mode == "lockstep":
        exact.apply(model, "cuda")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 151000, (args.batch, args.seq), generator=gen).cuda()
    with torch.no_grad():
        for _ in range(2):  # warm-up: Triton / inductor compiles
            _score(model, ids, mode)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.iters):
            _score(model, ids, mode)
        torch.cuda.synchronize()
    return args.iters * args.batch * args.seq / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    ops = sglang_source.batch_invariant_ops()
    rates = {mode: _tok_per_s(mode, args, ops) for mode in ("default", "lockstep", "sglang")}
    ops.disable_batch_invariant_mode()
    print(
        f"trainer scoring, Qwen3-0.6B shape ({args.layers} layers), batch {args.batch} x {args.seq} tokens, "
        f"{torch.cuda.get_device_name()}"
    )
    for mode, rate in rates.items():
        print(f"{mode:9s} {rate:12.1f} tok/s   ratio to default {rate / rates['default']:.3f}")


if __name__ == "__main__":
    main()
