"""The learning-run figure: `lockstep run examples/tiny-local.yaml` end to end, timed and summarised.

Why it exists: the main job's promise (README) is a run on 2 CPU cores that finishes in <= 10 min with the mean
reward rising from <= 0.2 to >= 0.8, reproducibly with the same seed, reporting the train-rollout logprob
abs diff every step. The rise must be the RL phase's own: the example's SFT warm start is short, so RL
starts low. This script runs exactly the README's command in a subprocess (`--repeat 2` runs it twice
with the same seed) and reads each run's metrics.jsonl. It prints and writes:
- the RL start window: mean sampled train reward (exact match, T=1) of RL steps 1-5, against <= 0.2;
- the RL end window: the same mean over the last 10 RL steps, against >= 0.8 (as a ratio to 0.8);
- the wall time against the 600 s budget, and the run's CPU time (user + sys of the subprocess: on a
  shared 2-core machine this is the better estimate of the quiet-machine wall time);
- the greedy eval reward before any training, at RL step 0 (after the warm start) and at the end;
- the per-step train_rollout_logprob_abs_diff distribution;
- with --repeat >= 2: whether every run has identical per-step train rewards and evals.
It is a benchmark, not a test: it takes minutes per run.

Run: .venv/bin/python bench/trainer_tiny_run.py [--manifest examples/tiny-local.yaml] [--repeat 2]
     [--out bench/results]   (writes trainer_tiny_run_<date>_cpu.md there)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BUDGET_S = 600.0
"""The main job's wall-time budget on 2 CPU cores."""
START_WINDOW = 5
"""RL steps averaged for the start figure (steps 1..START_WINDOW)."""
END_WINDOW = 10
"""RL steps averaged for the end figure (the last END_WINDOW steps)."""
START_GOAL = 0.2
"""The RL phase must start at or below this mean reward."""
END_GOAL = 0.8
"""... and end at or above this one."""


def summarise(rows: list[dict[str, Any]], wall_s: float, cpu_s: float) -> dict[str, Any]:
    """Pure: one run's metrics.jsonl rows + wall and CPU seconds -> the figure's numbers."""
    train = [r for r in rows if r["kind"] == "train"]
    if len(train) < START_WINDOW + END_WINDOW:
        raise ValueError(
            f"the run has {len(train)} RL steps; the figure needs >= {START_WINDOW + END_WINDOW}"
        )
    evals = {r["step"]: r["reward_mean"] for r in rows if r["kind"] == "eval"}
    init = [r["reward_mean"] for r in rows if r["kind"] == "eval_init"]
    diffs = [r["train_rollout_logprob_abs_diff"] for r in train]
    rewards = [r["reward_mean"] for r in train]
    start = statistics.mean(rewards[:START_WINDOW])
    end = statistics.mean(rewards[-END_WINDOW:])
    # First RL step at which the mean of the END_WINDOW steps ending there reaches the goal.
    reached = next(
        (
            i
            for i in range(END_WINDOW, len(rewards) + 1)
            if statistics.mean(rewards[i - END_WINDOW : i]) >= END_GOAL
        ),
        None,
    )
    return {
        "wall_s": round(wall_s, 1),
        "wall_over_budget": round(wall_s / BUDGET_S, 3),
        "cpu_s": round(cpu_s, 1),
        "cpu_over_budget": round(cpu_s / BUDGET_S, 3),
        "sft_steps": sum(r["kind"] == "sft" for r in rows),
        "rl_steps": len(train),
        "rl_start_reward": round(start, 4),
        "rl_start_ok": start <= START_GOAL,
        "rl_end_reward": round(end, 4),
        "rl_end_over_goal": round(end / END_GOAL, 3),
        "rl_end_ok": end >= END_GOAL,
        "rl_step_goal_first_reached": reached,
        "eval_reward_before_training": init[0] if init else None,
        "eval_reward_rl_start": evals.get(0),
        "eval_reward_end": evals[max(evals)] if evals else None,
        "eval_curve": evals,
        "logprob_abs_diff_steps_reported": sum(d is not None for d in diffs),
        "logprob_abs_diff_median": statistics.median(diffs),
        "logprob_abs_diff_max": max(diffs),
        "train_rewards": rewards,
    }


class LoadSampler:
    """Samples the 1-minute load average every `period_s` while a run is going (the machine is shared)."""

    def __init__(self, period_s: float = 5.0) -> None:
        self.period_s = period_s
        """Seconds between samples."""
        self.samples: list[float] = []
        """1-minute load averages seen so far."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_once(manifest: Path, run_dir: Path) -> tuple[list[dict[str, Any]], float, float, list[float]]:
    """Run `lockstep run manifest` into a fresh run_dir; returns (metrics rows, wall s, CPU s, loads)."""
    cmd = [str(Path(sys.executable).with_name("lockstep")), "run", str(manifest), "--run-dir", str(run_dir)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    with LoadSampler() as load:
        subprocess.run(cmd, check=True)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    text = (run_dir / "metrics.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return rows, wall, cpu, load.samples


def markdown(res: dict[str, Any]) -> str:
    """The results file: one column per run."""
    runs: list[dict[str, Any]] = res["runs"]
    head = "| metric | " + " | ".join(f"run {chr(65 + i)}" for i in range(len(runs))) + " |"
    lines = [
        f"# The learning run: `{res['command']}` on {res['cpus']} CPU cores ({res['date']})",
        "",
        f"Command: `.venv/bin/python bench/trainer_tiny_run.py --repeat {len(runs)} --out bench/results` "
        "(runs the command in a subprocess, same seed each time, and summarises metrics.jsonl). "
        "The machine is shared: the 1-minute load average is sampled every 5 s during each run (2 cores: "
        "a load above 2 means the run waited for a core); CPU time is user + sys of the run's process "
        "(it can exceed the wall time: torch uses both cores, and busy-waits under contention).",
        "",
        "Rewards are exact match (1 for the exactly reversed string, else 0). Train rewards are the sampled "
        "RL batches (T=1); eval is greedy on the 64 held-out prompts. The SFT warm start runs before RL step 1.",
        "",
        head,
        "|---|" + "---|" * len(runs),
    ]
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("wall time (s) / 600 s budget", lambda r: f"{r['wall_s']} ({r['wall_over_budget']})"),
        ("CPU time (s) / 600 s budget", lambda r: f"{r['cpu_s']} ({r['cpu_over_budget']})"),
        ("load average during the run: mean, max", lambda r: f"{r['load_mean']}, {r['load_max']}"),
        ("SFT warm-start steps, RL steps", lambda r: f"{r['sft_steps']}, {r['rl_steps']}"),
        (
            f"**RL start**: train reward, mean of RL steps 1-{START_WINDOW} (goal <= {START_GOAL})",
            lambda r: f"**{r['rl_start_reward']}**",
        ),
        (
            f"**RL end**: train reward, mean of the last {END_WINDOW} RL steps (goal >= {END_GOAL})",
            lambda r: f"**{r['rl_end_reward']}** ({r['rl_end_over_goal']} x goal)",
        ),
        (
            f"first RL step whose last-{END_WINDOW} mean reaches {END_GOAL}",
            lambda r: str(r["rl_step_goal_first_reached"]),
        ),
        ("eval reward before any training (greedy)", lambda r: str(r["eval_reward_before_training"])),
        ("eval reward at RL step 0, after the warm start (greedy)", lambda r: str(r["eval_reward_rl_start"])),
        ("eval reward at the end (greedy)", lambda r: str(r["eval_reward_end"])),
        (
            "eval curve (step: reward)",
            lambda r: ", ".join(f"{k}: {v:.3g}" for k, v in r["eval_curve"].items()),
        ),
        (
            "train_rollout_logprob_abs_diff: steps reported, median, max",
            lambda r: (
                f"{r['logprob_abs_diff_steps_reported']}, {r['logprob_abs_diff_median']:.2g}, "
                f"{r['logprob_abs_diff_max']:.2g}"
            ),
        ),
    ]
    for name, fmt in rows:
        lines.append(f"| {name} | " + " | ".join(fmt(r) for r in runs) + " |")
    lines.append("")
    if len(runs) > 1:
        same = "identical" if res["reproducible"] else "NOT identical"
        lines.append(f"Reproducibility: per-step train rewards and eval rewards of the runs are **{same}**.")
    curve = runs[0]["train_rewards"]
    blocks = [statistics.mean(curve[i : i + 25]) for i in range(0, len(curve), 25)]
    lines.append(
        "Train reward of run A, mean per 25 RL steps: " + ", ".join(f"{b:.2f}" for b in blocks) + "."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manifest", type=Path, default=Path("examples/tiny-local.yaml"))
    p.add_argument("--repeat", type=int, default=1, help="runs with the same seed (2 checks reproducibility)")
    p.add_argument("--out", type=Path, default=None, help="write trainer_tiny_run_<date>_cpu.md here")
    args = p.parse_args()
    runs = []
    for _ in range(args.repeat):
        rows, wall, cpu, loads = run_once(args.manifest, Path(tempfile.mkdtemp(prefix="lockstep-tiny-run-")))
        one = summarise(rows, wall, cpu)
        one["load_mean"] = round(statistics.mean(loads), 2) if loads else None
        one["load_max"] = round(max(loads), 2) if loads else None
        runs.append(one)
    out: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count(),
        "command": f"lockstep run {args.manifest}",
        "runs": runs,
        "reproducible": all(
            (r["train_rewards"], r["eval_curve"]) == (runs[0]["train_rewards"], runs[0]["eval_curve"])
            for r in runs
        ),
    }
    for i, r in enumerate(runs):
        print(f"run {chr(65 + i)}")
        for k, v in r.items():
            if k != "train_rewards":
                print(f"  {k:34s} {v}")
    if len(runs) > 1:
        print(f"reproducible (identical per-step rewards and evals): {out['reproducible']}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"trainer_tiny_run_{out['date']}_cpu.md"
        path.write_text(markdown(out))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
