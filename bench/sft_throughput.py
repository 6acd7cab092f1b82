"""SFT step tokens/s against the RL trainer step on the same model, same rows, same backend.

Why it exists: an SFT job (docs/distillation.md) is the RL trainer without the rollout: the figure says
what one SFT optimizer step costs next to one RL step on the same batch. The FSDP2 backend (world size 1)
holds the built-in tiny-deep model (or `--model`); `--rows` rows of a prompt and a response of
`--response` tokens are trained both ways, alternating, `--iters` times:
- SFT: `train_step` with the token-mean NLL on the response tokens (lockstep.trainer.sft's step;
  pack_masked);
- RL: the two calls of an RL step, `compute_logprobs` (the pre-update pass) and `train_step` with the
  GRPO policy loss (pack_groups of the same rows in groups of 8).
Printed: sequence tokens/s (every position computed, prompt included) of each, and SFT's ratio to RL
(the baseline measured in the same run).

Run: PYTHONPATH=runtime python bench/sft_throughput.py --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import random
import tempfile
import time
from pathlib import Path

import torch
from lockstep.models.tiny import materialize_builtin
from lockstep.train.common.losses import PolicyLossConfig, make_policy_loss, sft_loss
from lockstep.train.common.packing import pack_groups, pack_masked
from lockstep.train.fsdp import FSDPBackend, FSDPConfig
from lockstep.types import Group, Sample


def _rows(n: int, prompt: int, response: int, vocab: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(0)
    return [([rng.randrange(6, vocab) for _ in range(prompt)], [rng.randrange(6, vocab) for _ in range(response)])
            for _ in range(n)]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:tiny-deep")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=10)
    ap.add_argument("--response", type=int, default=6)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = materialize_builtin(args.model, Path(tempfile.mkdtemp()) / "m", seed=0)
    backend = FSDPBackend(
        FSDPConfig(model_path=path, lr=1e-5, device="cpu", dtype="float32", micro_batch_size=64)
    )
    vocab = int(backend.model.config.vocab_size)
    pairs = _rows(args.rows, args.prompt, args.response, vocab)
    sft = pack_masked([(p + r, [0] * len(p) + [1] * len(r)) for p, r in pairs])
    groups = [
        Group(g, [Sample(g, i, p, r, [1] * len(r), [-1.0] * len(r), [0] * len(r), reward=float(i % 2))
                  for i, (p, r) in enumerate(pairs[g * 8 : g * 8 + 8])])
        for g in range(args.rows // 8)
    ]  # fmt: skip
    rl = pack_groups(groups, "grpo")
    loss = make_policy_loss(PolicyLossConfig())
    tokens = int(sft.attention_mask.sum().item())
    backend.train_step(sft, sft_loss)  # warm-up
    t_sft = t_rl = 0.0
    for _ in range(args.iters):
        t0 = time.perf_counter()
        backend.train_step(sft, sft_loss)
        t_sft += time.perf_counter() - t0
        t0 = time.perf_counter()
        rl.old_logprobs = backend.compute_logprobs(rl)
        backend.train_step(rl, loss)
        t_rl += time.perf_counter() - t0
    backend.close()
    sft_rate, rl_rate = tokens * args.iters / t_sft, tokens * args.iters / t_rl
    lines = [
        f"model {args.model}, {args.rows} rows x ({args.prompt} prompt + {args.response} response) tokens = "
        f"{tokens} tokens per step, {args.iters} steps each, CPU, 1 torch thread",
        "| step | seconds per step | tokens/s | vs the RL step |",
        "| --- | --- | --- | --- |",
        f"| RL step: compute_logprobs + train_step (baseline) | {t_rl / args.iters:.3f} | {rl_rate:.0f} | 1.00x |",
        f"| SFT step: train_step | {t_sft / args.iters:.3f} | {sft_rate:.0f} | {sft_rate / rl_rate:.2f}x |",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        day = datetime.date.today().isoformat()
        out = args.out / f"sft_throughput_{day}_cpu.md"
        out.write_text(
            "# SFT step vs RL trainer step, same model and rows (FSDP2, CPU)\n\n"
            "`PYTHONPATH=runtime python bench/sft_throughput.py --out bench/results`\n\n" + text + "\n"
        )
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
