"""The learning-run figure: `lockstep run examples/tiny-local.yaml` end to end, timed and summarised.

Why it exists: the issue's "done when" is a run on 2 CPU cores that finishes in <= 10 min with the
mean reward rising from <= 0.2 to >= 0.8, reporting the train-rollout logprob abs diff every step. This
script runs exactly the README's command in a subprocess, then reads the run's metrics.jsonl and prints
the wall time as a ratio to the 600 s budget, the reward before any training, after the SFT warm start
(RL step 0) and at the end (greedy eval and the sampled train batches), and the per-step
train_rollout_logprob_abs_diff distribution. It is a benchmark, not a test: it takes minutes.

Run: .venv/bin/python bench/trainer_tiny_run.py [--manifest examples/tiny-local.yaml] [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BUDGET_S = 600.0
"""The issue's wall-time budget on 2 CPU cores."""


def summarise(rows: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Pure: metrics.jsonl rows + wall time -> the figure's numbers."""
    train = [r for r in rows if r["kind"] == "train"]
    evals = {r["step"]: r["reward_mean"] for r in rows if r["kind"] == "eval"}
    init = [r["reward_mean"] for r in rows if r["kind"] == "eval_init"]
    diffs = [r["train_rollout_logprob_abs_diff"] for r in train]
    first, last = train[:10], train[-10:]
    return {
        "wall_s": round(wall_s, 1),
        "wall_over_budget": round(wall_s / BUDGET_S, 3),
        "rl_steps": len(train),
        "sft_steps": sum(r["kind"] == "sft" for r in rows),
        "eval_reward_before_training": init[0] if init else None,
        "eval_reward_rl_start": evals.get(0),
        "eval_reward_end": evals[max(evals)] if evals else None,
        "train_reward_first10_mean": round(statistics.mean(r["reward_mean"] for r in first), 4),
        "train_reward_last10_mean": round(statistics.mean(r["reward_mean"] for r in last), 4),
        "train_reward_step1": train[0]["reward_mean"],
        "logprob_abs_diff_steps_reported": len(diffs),
        "logprob_abs_diff_median": statistics.median(diffs),
        "logprob_abs_diff_max": max(diffs),
        "eval_curve": evals,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--manifest", type=Path, default=Path("examples/tiny-local.yaml"))
    p.add_argument("--run-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="write trainer_tiny_run_<date>_cpu.json here")
    args = p.parse_args()
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="lockstep-tiny-run-"))
    cmd = [
        str(Path(sys.executable).with_name("lockstep")),
        "run",
        str(args.manifest),
        "--run-dir",
        str(run_dir),
    ]
    t0 = time.monotonic()
    subprocess.run(cmd, check=True)
    wall = time.monotonic() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    res = {
        "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count(),
        "command": " ".join(["lockstep", *cmd[1:]]),
        **summarise(rows, wall),
    }
    for k, v in res.items():
        print(f"{k:34s} {v}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"trainer_tiny_run_{res['date']}_cpu.json"
        path.write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
