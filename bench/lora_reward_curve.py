"""Reward curve of the LoRA example against full fine-tuning on the same task, model and seeds.

Why it exists: LoRA trains ~1/60 of the state of full fine-tuning (bench/lora_memory.py); the question
a user asks is what that costs in learning. This reads two seed sweeps of bench/seed_sweep.py (their
JSON keeps every RL step's sampled train reward per seed): the LoRA example
(`python bench/seed_sweep.py --manifest examples/tiny-lora.yaml --seeds 7 0 1 --label lora`) and the
full-weight example (examples/tiny-local.yaml: the same builtin:tiny-deep model, reverse task, GRPO,
8 samples x 16 prompts, SFT warm start to loss 0.5; seeds 7, 0, 1), and prints, per seed present in
both, the mean sampled reward over windows of RL steps, the first-5 and last-10 figures and the step
at which the 10-step moving average first reaches 0.8. The ratio is LoRA / full for the last-10 reward.
With --png it also draws both curves (10-step moving average) per seed.

Run: .venv/bin/python bench/lora_reward_curve.py --lora bench/results/seed_sweep_2026-12-04_lora.json
     [--full bench/results/seed_sweep_2026-12-03_example.json] [--out bench/results --date 2026-12-04]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

WINDOWS = ((1, 5), (6, 50), (51, 100), (101, 200), (201, 300), (301, 500))


def _moving(xs: list[float], k: int = 10) -> list[float]:
    return [statistics.mean(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def _first_reach(xs: list[float], goal: float = 0.8) -> int | None:
    return next((i + 1 for i, v in enumerate(_moving(xs)) if v >= goal), None)


def _window(xs: list[float], a: int, b: int) -> str:
    part = xs[a - 1 : b]
    return f"{statistics.mean(part):.2f}" if part and len(xs) >= b else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lora", type=Path, required=True)
    p.add_argument("--full", type=Path, default=Path("bench/results/seed_sweep_2026-12-03_example.json"))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--date", default="2026-12-04")
    p.add_argument("--device", default="cpu")
    p.add_argument("--png", action="store_true")
    args = p.parse_args()
    lora: dict[str, Any] = json.loads(args.lora.read_text())["per_seed"]
    full: dict[str, Any] = json.loads(args.full.read_text())["per_seed"]
    seeds = [s for s in lora if s in full and lora[s].get("train_rewards")]
    lines = [
        f"# Reward curve: LoRA vs full fine-tuning on the tiny example ({args.date}, {args.device})",
        "",
        f"LoRA: `{args.lora}` (examples/tiny-lora.yaml: rank 16 on every linear layer and lm_head, base "
        f"frozen). Full: `{args.full}` (examples/tiny-local.yaml). Same model, task, batch and seeds; sampled "
        "train reward (exact match at T=1) per RL step, mean over windows of steps.",
        "",
        "| seed | run | " + " | ".join(f"steps {a}-{b}" for a, b in WINDOWS) + " | first-5 | last-10 | "
        "steps to 10-step mean 0.8 |",
        "| --- | --- | " + " | ".join("---" for _ in WINDOWS) + " | --- | --- | --- |",
    ]
    ratios = []
    for s in seeds:
        for label, run in (("LoRA", lora[s]), ("full", full[s])):
            xs = [float(x) for x in run["train_rewards"]]
            lines.append(
                f"| {s} | {label} ({len(xs)} steps) | "
                + " | ".join(_window(xs, a, b) for a, b in WINDOWS)
                + f" | {run['first5']:.2f} | {run['last10']:.2f} | {_first_reach(xs) or '-'} |"
            )
        ratios.append(lora[s]["last10"] / full[s]["last10"])
    if ratios:
        lines += [
            "",
            f"Last-10 reward LoRA / full: {', '.join(f'{r:.2f}' for r in ratios)} (seeds {', '.join(seeds)}).",
        ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is None:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"lora_reward_curve_{args.date}_{args.device}"
    stem.with_suffix(".md").write_text(text)
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for s in seeds:
            ax.plot(_moving([float(x) for x in lora[s]["train_rewards"]]), label=f"LoRA seed {s}")
            ax.plot(_moving([float(x) for x in full[s]["train_rewards"]]), "--", label=f"full seed {s}")
        ax.set_xlabel("RL step")
        ax.set_ylabel("sampled reward (10-step mean)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(stem.with_suffix(".png"), dpi=100)


if __name__ == "__main__":
    main()
