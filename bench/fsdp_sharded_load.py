"""Peak host memory per FSDP2 rank loading a multi-GB checkpoint: sharded load vs the whole-model load.

Why: a rank that loads the whole model before sharding it needs the whole checkpoint in host memory
(8 ranks of a host: 8 copies), so a model larger than one host cannot start. With sharded loading
(lockstep.train.fsdp.sharded_load) each rank builds on the meta device and reads only its rows. For 1,
2 and 4 gloo ranks (torchrun on this machine) and each mode, every rank reports its peak RSS increase
while the backend is built (runtime/tests/train/fsdp_load_rank.py: imports warmed up, the kernel's
peak mark reset first), and with `--save` the peak of a save too. Printed: the largest peak of any
rank / the checkpoint size, beside the ideal 1 / ranks, and the sharded / whole ratio of the same run.

Run from the repository root (needs free memory: ranks x checkpoint for the whole-model rows):
  PYTHONPATH=runtime .venv/bin/python bench/fsdp_sharded_load.py [--gb 2] [--ranks 1 2 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RANK = Path(__file__).resolve().parents[1] / "runtime" / "tests" / "train" / "fsdp_load_rank.py"


def fixture(directory: Path, gb: float) -> int:
    """A Qwen3 checkpoint of about `gb` GB (fp32, random init); returns its size in bytes."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    layers = max(1, round(gb * 1e9 / 4 / 50.3e6))  # ~50.3M parameters per layer at this width
    cfg = Qwen3Config(vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(directory, max_shard_size="1GB")
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def run(checkpoint: Path, mode: str, ranks: int, out: Path, save: Path | None) -> list[dict]:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(ranks), str(RANK), "--checkpoint",
           str(checkpoint), "--mode", mode, "--out", str(out), "--no-digest"]  # fmt: skip
    if save is not None:
        cmd += ["--save", str(save)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return [json.loads(line) for line in out.read_text().splitlines()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--tmp", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lines = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        ckpt = Path(tmp) / "ckpt"
        size = fixture(ckpt, args.gb)
        lines.append(
            f"# {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {os.uname().nodename}, load {os.getloadavg()[0]:.1f}; "
            f"Qwen3 fp32 checkpoint {size / 1e9:.2f} GB, gloo ranks on this machine"
        )
        lines.append(
            f"{'ranks':>5} {'ideal':>6} {'sharded load':>13} {'whole load':>11} {'sharded/whole':>14} {'sharded save':>13}"
        )
        for ranks in args.ranks:
            peaks = {}
            for mode in ("sharded", "whole"):
                out = Path(tmp) / f"{mode}-{ranks}.jsonl"
                save = Path(tmp) / f"saved-{ranks}" if mode == "sharded" else None
                peaks[mode] = run(ckpt, mode, ranks, out, save)
            load = {m: max(r["peak_bytes"] for r in rs) / size for m, rs in peaks.items()}
            saved = max(r["save_peak_bytes"] for r in peaks["sharded"]) / size
            lines.append(f"{ranks:>5} {1 / ranks:>6.3f} {load['sharded']:>13.3f} {load['whole']:>11.3f} "
                         f"{load['sharded'] / load['whole']:>14.3f} {saved:>13.3f}")  # fmt: skip
    lines.append("# columns: the largest peak RSS increase of any rank / the checkpoint size")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
