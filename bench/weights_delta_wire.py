"""Disk-delta wire bytes at 1%, 3% and 10% of bf16 elements changed, as a compression ratio.

Why: the disk-delta transport (lockstep.weights.disk_delta) is worth it only when a version's delta is
far smaller than the model; the goal is >= 60x fewer bytes than the bf16 checkpoint at 1% changed
elements. A step of RL fine-tuning moves most bf16 weights by less than one ulp, and the ones that
move mostly by one ulp, so the synthetic step changes exactly the given fraction of elements by +-1
ulp (a uniformly random subset). Each row publishes one version with the real publisher (safetensors
base checkpoint, zstd level 1) and reports wire bytes (shards + index) and the ratio
checkpoint bytes / wire bytes, for both encodings.

Run from the repository root:  .venv/bin/python bench/weights_delta_wire.py [--mib 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from lockstep.weights.disk_delta import DeltaPublisher
from safetensors.torch import save_file

GOAL_AT_1PCT = 60.0


def model(mib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 tensors of LLM-like shapes and magnitudes (std 0.02) totalling about `mib` MiB."""
    g = torch.Generator().manual_seed(seed)
    out, total, i = {}, 0, 0
    while total < mib << 20:
        t = (torch.randn(1024, 2048, generator=g) * 0.02).bfloat16()
        out[f"model.layers.{i}.mlp.up_proj.weight"] = t
        total += t.numel() * 2
        i += 1
    return out


def ulp_step(sd: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    """Change exactly round(frac * numel) elements of each tensor by +-1 ulp."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in sd.items():
        bits = t.clone().view(torch.int16).reshape(-1)
        k = round(frac * bits.numel())
        idx = torch.randperm(bits.numel(), generator=g)[:k]
        sign = torch.randint(0, 2, (k,), generator=g, dtype=torch.int16) * 2 - 1
        bits[idx] += sign  # +-1 in the bit pattern = the next/previous representable value
        out[name] = bits.view(torch.bfloat16).view(t.shape)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="model size in MiB of bf16")
    args = ap.parse_args()
    base = model(args.mib)
    total = sum(t.numel() * 2 for t in base.values())
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "base"
        ckpt.mkdir()
        save_file(base, ckpt / "model.safetensors")
        print(f"checkpoint: {total / 2**20:.0f} MiB of bf16, {len(base)} tensors")
        print(f"{'changed':>8} {'encoding':>9} {'density':>8} {'wire bytes':>12} {'ratio':>8}")
        for frac in (0.01, 0.03, 0.10):
            new = ulp_step(base, frac, seed=int(frac * 1000))
            for enc in ("xor", "overwrite"):
                root = Path(tmp) / f"root-{frac}-{enc}"
                pub = DeltaPublisher(root, ckpt, encoding=enc)
                r = pub.publish(new.items(), 1)
                ratio = total / r.wire_bytes
                print(f"{frac:>8.0%} {enc:>9} {r.density:>8.4f} {r.wire_bytes:>12,d} {ratio:>7.1f}x")
                if frac == 0.01 and enc == "xor":
                    ok = ratio >= GOAL_AT_1PCT
    print(f"goal: >= {GOAL_AT_1PCT:.0f}x at 1% with the default encoding (xor): {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
