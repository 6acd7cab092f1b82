"""Trainer tokens/s of the FSDP2 backend, with the ratio to a bf16 matmul peak measured in the same run.

Why it exists: the figure "trainer tokens/s" on an H200 with the ~0.6B Qwen3-shaped random-init
model (lockstep.models.tiny.bigger_config). It times the two calls the RL loop makes per step through
the real backend (lockstep.train.fsdp.FSDPBackend, world size 1): `compute_logprobs` (the train_old
pass, forward only) and `train_step` (forward + backward + AdamW, the policy loss of the RL loop with
TIS on). Model FLOPs are counted as 2*N*tokens (forward) and 6*N*tokens (train) plus attention, and
divided by a dense bf16 matmul rate measured in the same process (the physical ceiling), so the
printed MFU is a ratio measured on the same machine in the same run.

Run (GPU):   PYTHONPATH=runtime python bench/trainer_throughput.py --device cuda --out bench/results
Smoke (CPU): PYTHONPATH=runtime python bench/trainer_throughput.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lockstep.models.tiny import bigger_config, tiny_config
from lockstep.train.common.losses import PolicyLossConfig, make_policy_loss
from lockstep.train.common.mismatch import MismatchConfig
from lockstep.train.common.packing import pack_groups
from lockstep.train.fsdp import FSDPBackend, FSDPConfig
from lockstep.types import Group, Sample


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_peak_tflops(device: str, n: int, iters: int) -> float:
    """Dense matmul rate (bf16 on CUDA, fp32 on CPU) on random data: the ceiling MFU is measured against."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    _sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


def make_groups(n_groups: int, group: int, prompt: int, response: int, vocab: int, seed: int) -> list[Group]:
    """Synthetic complete groups with fixed lengths and rollout logprobs near the trainer's."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(n_groups):
        p = torch.randint(10, vocab, (prompt,), generator=g).tolist()
        samples = []
        for si in range(group):
            r = torch.randint(10, vocab, (response,), generator=g).tolist()
            samples.append(
                Sample(gi, si, p, r, [1] * response, [-5.0] * response, [0] * response, reward=float(si % 2))
            )
        out.append(Group(gi, samples))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = tiny_config() if args.tiny else bigger_config()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    with tempfile.TemporaryDirectory() as d:
        cfg.save_pretrained(d)  # config only: random init from the seed, nothing heavy written
        backend = FSDPBackend(
            FSDPConfig(
                model_path=Path(d),
                lr=1e-5,
                device=args.device,
                dtype=dtype,
                micro_batch_size=args.micro_batch,
            )
        )
    params = sum(p.numel() for p in backend.model.parameters())
    groups = make_groups(args.groups, args.group_size, args.prompt_len, args.response_len, cfg.vocab_size, 0)
    batch = pack_groups(groups, "grpo", 0)
    tokens = int(batch.attention_mask.sum().item())  # every position is computed, prompt included
    loss = make_policy_loss(PolicyLossConfig(mismatch=MismatchConfig("tis")))
    batch.old_logprobs = backend.compute_logprobs(batch)  # warm-up (allocator, kernels)
    backend.train_step(batch, loss)
    _sync(args.device)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        batch.old_logprobs = backend.compute_logprobs(batch)
    _sync(args.device)
    t_fwd = (time.perf_counter() - t0) / args.iters
    t0 = time.perf_counter()
    for _ in range(args.iters):
        result = backend.train_step(batch, loss)
    _sync(args.device)
    t_train = (time.perf_counter() - t0) / args.iters
    seq = batch.input_ids.shape[1]
    # Attention score + value matmuls: 2 * 2 * layers * seq * hidden_attn per token (forward).
    attn = 4 * cfg.num_hidden_layers * seq * cfg.num_attention_heads * cfg.head_dim
    fwd_flops = tokens * (2 * params + attn)
    peak = matmul_peak_tflops(args.device, 8192 if args.device == "cuda" else 1024, args.peak_iters)
    backend.close()
    res: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": "tiny_config()" if args.tiny else "bigger_config() (Qwen3-0.6B-shaped, random init)",
        "params": params,
        "dtype": dtype,
        "batch": f"{args.groups} groups x {args.group_size} samples, prompt {args.prompt_len} + response {args.response_len}",
        "tokens_per_step": tokens,
        "micro_batch": args.micro_batch,
        "logprobs_tokens_per_s": round(tokens / t_fwd, 1),
        "train_tokens_per_s": round(tokens / t_train, 1),
        "train_step_s": round(t_train, 4),
        "train_tflops": round(3 * fwd_flops / t_train / 1e12, 2),
        "matmul_peak_tflops": round(peak, 1),
        "train_mfu_vs_measured_peak": round(3 * fwd_flops / t_train / 1e12 / peak, 4),
        "logprobs_mfu_vs_measured_peak": round(fwd_flops / t_fwd / 1e12 / peak, 4),
        "last_loss": result.loss,
        "peak_memory_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if args.device == "cuda"
        else None,
        "command": "PYTHONPATH=runtime python bench/trainer_throughput.py " + " ".join(args.argv),
    }
    return res


def main() -> None:
    import sys

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test)")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=768)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--peak-iters", type=int, default=50)
    p.add_argument(
        "--out", type=Path, default=None, help="directory for trainer_throughput_<date>_<device>.json"
    )
    args = p.parse_args()
    args.argv = sys.argv[1:]
    res = run(args)
    for k, v in res.items():
        print(f"{k:32s} {v}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        tag = "h200" if "H200" in str(res["device"]) else str(res["device"]).replace(" ", "_").lower()
        path = args.out / f"trainer_throughput_{res['date']}_{tag}.json"
        path.write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
