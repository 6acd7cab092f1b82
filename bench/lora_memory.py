"""Trainer memory with and without LoRA: what the FSDP backend holds after one optimizer step.

Why it exists: a LoRA job freezes the base, so it holds no gradient and no optimizer state for it
(docs/lora.md). This builds the same Qwen3-architecture model (a random init written offline) twice,
each in a subprocess of its own (so the peak resident set is that configuration's alone): the full
FSDPBackend and the one with a rank-r adapter on every linear layer of the decoder; each takes one
optimizer step on the same batch. Reported per configuration: parameter bytes (all, and trainable),
gradient bytes, AdamW state bytes (their sum is the training state the accelerator must hold), and the
process's peak RSS. Ratios: full / LoRA, measured in the same run.

Run: .venv/bin/python bench/lora_memory.py [--hidden 768 --layers 6 --vocab 32000 --rank 16]
     [--out bench/results --date 2026-12-04 --device cpu]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _measure(model: str, rank: int) -> dict[str, Any]:
    import torch
    from lockstep.train.common.losses import sft_loss
    from lockstep.train.common.packing import pack_sft
    from lockstep.train.fsdp import FSDPBackend, FSDPConfig
    from lockstep.train.fsdp.lora import AdapterConfig

    torch.set_num_threads(1)
    lora = AdapterConfig(rank=rank, alpha=2 * rank, name="bench") if rank else None
    b = FSDPBackend(FSDPConfig(model_path=Path(model), device="cpu", lora=lora, micro_batch_size=8))
    batch = pack_sft([([1 + i, 2, 3, 4] * 8, [5, 6, 7, 8] * 8) for i in range(8)])
    b.train_step(batch, sft_loss)
    for p in b.trainable():  # the gradients as they are at the optimizer step (zero_grad drops them)
        p.grad = torch.zeros_like(p)

    def nbytes(t: Any) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return int(local.numel() * local.element_size())

    params = list(b.model.parameters())
    out = {
        "param_bytes": sum(nbytes(p) for p in params),
        "trainable_bytes": sum(nbytes(p) for p in params if p.requires_grad),
        "grad_bytes": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer_bytes": sum(
            nbytes(v) for st in b.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)
        ),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    b.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "RANK"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_measure(args.child[0], int(args.child[1]))))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from lora_sync import _model_dir

    model = _model_dir(Path(tempfile.mkdtemp(prefix="lora-mem-")), args.hidden, args.layers, args.vocab)
    runs = {}
    for label, rank in (("full fine-tuning", 0), (f"LoRA rank {args.rank}", args.rank)):
        proc = subprocess.run(
            [sys.executable, __file__, "--child", str(model), str(rank)],
            capture_output=True, text=True, check=True, env={"OMP_NUM_THREADS": "1", **__import__("os").environ},
        )  # fmt: skip
        runs[label] = json.loads(proc.stdout.strip().splitlines()[-1])
    full, lora = runs["full fine-tuning"], runs[f"LoRA rank {args.rank}"]
    state = {k: v["trainable_bytes"] + v["grad_bytes"] + v["optimizer_bytes"] for k, v in runs.items()}
    lines = [
        f"# Trainer memory with and without LoRA ({args.date}, {args.device})",
        "",
        f"FSDP backend, one CPU rank, fp32; Qwen3-architecture model, hidden {args.hidden}, {args.layers} layers, "
        f"vocab {args.vocab} ({full['param_bytes'] / 4 / 1e6:.1f} M parameters); after one AdamW step on the "
        f"same batch. Command: `python bench/lora_memory.py --hidden {args.hidden} --layers {args.layers} "
        f"--vocab {args.vocab} --rank {args.rank}`",
        "",
        "| configuration | parameters | trainable | gradients | AdamW state | trainable+grad+optimizer | peak RSS |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    mib = 1 << 20
    for label, r in runs.items():
        lines.append(
            f"| {label} | {r['param_bytes'] / mib:.1f} MiB | {r['trainable_bytes'] / mib:.2f} MiB | "
            f"{r['grad_bytes'] / mib:.2f} MiB | {r['optimizer_bytes'] / mib:.2f} MiB | {state[label] / mib:.2f} MiB | "
            f"{r['peak_rss_bytes'] / mib:.0f} MiB |"
        )
    lines += [
        "",
        f"Ratio full / LoRA: training state (trainable + gradients + optimizer) "
        f"{state['full fine-tuning'] / state[f'LoRA rank {args.rank}']:.1f}x, all trainer memory besides "
        f"activations (parameters + gradients + optimizer) "
        f"{(full['param_bytes'] + full['grad_bytes'] + full['optimizer_bytes']) / (lora['param_bytes'] + lora['grad_bytes'] + lora['optimizer_bytes']):.2f}x, "
        f"peak RSS {full['peak_rss_bytes'] / lora['peak_rss_bytes']:.2f}x.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"lora_memory_{args.date}_{args.device}"
        stem.with_suffix(".md").write_text(text)
        stem.with_suffix(".json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
