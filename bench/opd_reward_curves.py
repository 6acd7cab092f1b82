"""OPD vs RL-only reward curves on the example: self-distillation of tiny-local (examples/tiny-opd.yaml).

Why it exists: §8.1's self-distillation in miniature, and the figure "OPD vs RL-only reward curves". The
teacher is examples/tiny-local.yaml's final checkpoint (500 GRPO steps), the student that run's checkpoint
from before RL (after its SFT warm start); both arms start from the same student with the same seed and
the same recipe (batch, learning rate, steps):
- OPD: taskReward zero, the teacher's d_t is the only training signal;
- RL-only (the baseline of the same run): GRPO on the task reward, no teacher.
For each seed it prints the task reward (sampled, temperature 1) of the first 5 and last 10 steps, the
gain, and OPD's gain as a ratio of RL's; with --teacher it also measures the teacher itself (5 steps
of OPD whose student is the teacher, learning rate ~0: its sampled task reward) and how much of the gap
from the student's first 5 steps to the teacher each arm's last 10 close; with --png it draws the
curves (5-step moving average, per seed) and the teacher's level. Needs runs/tiny-local (run the main
job first).

Run: PYTHONPATH=runtime python bench/opd_reward_curves.py --steps 100 --seeds 0 1 2 --teacher --png \
  --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

import yaml
from lockstep.cli import main as lockstep

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-opd.yaml"


def _job(arm: str, seed: int, lr: float, student: str | None = None) -> dict[str, Any]:
    job: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    spec = job["spec"]
    spec["data"]["seed"] = seed
    spec["algorithm"]["learningRate"] = lr
    spec["schedule"].pop("evalInterval", None)
    spec["data"].pop("evalPrompts", None)
    if student is not None:
        spec["model"]["checkpoint"] = student
    if arm == "rl":
        spec["algorithm"].pop("opd")
    job["metadata"]["name"] = f"curve-{arm}-{seed}"
    return job


def _curve(run_dir: Path, arm: str) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    key = "reward_mean" if arm == "rl" else "task_reward_mean"  # OPD (and the teacher run) trains on 0
    return [r[key] for r in rows if r["kind"] == "train"]


def run_arm(
    arm: str, seed: int, steps: int, lr: float, work: Path, student: str | None = None
) -> list[float]:
    path = work / f"{arm}-{seed}.yaml"
    path.write_text(yaml.safe_dump(_job(arm, seed, lr, student)))
    run_dir = work / f"{arm}-{seed}"
    code = lockstep(["run", str(path), "--run-dir", str(run_dir), "--steps", str(steps)])
    if code != 0:
        raise SystemExit(f"{arm} seed {seed}: lockstep run exited {code}")
    return _curve(run_dir, arm)


def _mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


def _summary(
    curves: dict[tuple[str, int], list[float]], arms: list[str], seeds: list[int], teacher: float | None
) -> list[str]:
    """Per arm over the seeds: mean first 5 and last 10, and with the teacher's level the share of the
    gap from the student's start to the teacher that the last 10 steps close."""
    lines = ["", "mean over seeds " + " ".join(map(str, seeds)) + ":", ""]
    head = "| arm | first 5 | last 10 | gain |" + (
        " gap to the teacher closed |" if teacher is not None else ""
    )
    lines += [head, "| --- " * (head.count("|") - 1) + "|"]
    for arm in arms:
        first = _mean([_mean(curves[(arm, s)][:5]) for s in seeds])
        last = _mean([_mean(curves[(arm, s)][-10:]) for s in seeds])
        row = f"| {arm} | {first:.3f} | {last:.3f} | {last - first:+.3f} |"
        if teacher is not None:
            row += f" {(last - first) / (teacher - first):.0%} |" if teacher != first else " n/a |"
        lines.append(row)
    if teacher is not None:
        lines.append(f"\nthe teacher's own sampled task reward (5 steps, learning rate ~0): {teacher:.3f}")
    return lines


def _plot(curves: dict[tuple[str, int], list[float]], teacher: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {"opd": "tab:blue", "rl": "tab:orange"}
    for (arm, seed), c in curves.items():
        w = 5
        smooth = [_mean(c[max(0, i - w + 1) : i + 1]) for i in range(len(c))]
        label = f"{arm} (OPD, task reward zero)" if arm == "opd" else f"{arm} (GRPO on the task reward)"
        ax.plot(
            smooth,
            color=colors.get(arm),
            alpha=0.8,
            label=label if seed == min(s for _, s in curves) else None,
        )
    if teacher is not None:
        ax.axhline(teacher, color="black", linestyle="--", label=f"the teacher ({teacher:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("sampled task reward (5-step mean)")
    ax.set_title("Self-distillation of tiny-local: OPD vs RL-only, one line per seed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--lr", type=float, default=3.0e-4)
    ap.add_argument("--arms", nargs="+", default=["opd", "rl"])
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "opd-curves")
    ap.add_argument("--teacher", action="store_true", help="also measure the teacher's sampled reward")
    ap.add_argument("--png", action="store_true", help="draw the curves next to the .md (needs --out)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    curves: dict[tuple[str, int], list[float]] = {}
    for seed in args.seeds:
        for arm in args.arms:
            curves[(arm, seed)] = run_arm(arm, seed, args.steps, args.lr, args.work)
    teacher = None
    if args.teacher:
        ckpt = yaml.safe_load(EXAMPLE.read_text())["spec"]["algorithm"]["opd"]["teachers"][0]["checkpoint"]
        teacher = _mean(run_arm("teacher", args.seeds[0], 5, 1e-12, args.work, student=ckpt)[:5])
    lines = [
        f"{args.steps} steps per arm, learning rate {args.lr}, batch 16 groups x 8 samples, sampled task reward "
        "(temperature 1) per step; OPD: taskReward zero (the teacher's signal only); RL: GRPO on the task reward",
        "",
        "| seed | arm | first 5 | last 10 | gain | OPD gain / RL gain |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for seed in args.seeds:
        gains = {}
        for arm in args.arms:
            c = curves[(arm, seed)]
            gains[arm] = _mean(c[-10:]) - _mean(c[:5])
            ratio = (
                f"{gains['opd'] / gains['rl']:.2f}x" if arm == "rl" and "opd" in gains and gains["rl"] else ""
            )
            lines.append(
                f"| {seed} | {arm} | {_mean(c[:5]):.3f} | {_mean(c[-10:]):.3f} | {gains[arm]:+.3f} | {ratio} |"
            )
    lines += _summary(curves, args.arms, args.seeds, teacher)
    lines.append("\nper-step curves (task reward):")
    for (arm, seed), c in curves.items():
        lines.append(f"- {arm} seed {seed}: " + " ".join(f"{x:.2f}" for x in c))
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        day = datetime.date.today().isoformat()
        out = args.out / f"opd_reward_curves_{day}_cpu.md"
        flags = (["--teacher"] if args.teacher else []) + (["--png"] if args.png else [])
        cmd = "PYTHONPATH=runtime python bench/opd_reward_curves.py " + " ".join(
            ["--steps", str(args.steps), "--seeds", *map(str, args.seeds), "--lr", str(args.lr), *flags]
        )
        out.write_text(
            f"# OPD vs RL-only reward curves (self-distillation of tiny-local, CPU)\n\n`{cmd}`\n\n{text}\n"
        )
        print(f"wrote {out}")
        if args.png:
            _plot(curves, teacher, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
