"""BF16 vs FP8 rollout of the tiny RL run, with and without TIS: logprob gap and reward, same machine.

Why it exists: the figure for §6's practical recipe (BF16 training, FP8 serving): how far
the served policy moves from the trained one (train_rollout_logprob_abs_diff, mismatch ratio) and
what it does to the reward, without and with TIS correcting the gap. Four runs of
examples/tiny-local.yaml, identical except spec.rollout.precision (bf16 | fp8, FP8 block-scaled by the
shared quantizer, every update through the QuantizingTransport) and
spec.algorithm.mismatch.correction (off | tis); same seed, same steps. Printed per run: the mean
logprob |diff| and mismatch ratio p99 over all steps, the mean reward of the last --last steps, and
the ratios to the BF16 / off run.

Run:    .venv/bin/python bench/fp8_rollout.py                 (--steps 150 by default, CPU)
Quick:  .venv/bin/python bench/fp8_rollout.py --steps 20 --last 5
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path
from statistics import mean

import yaml
from lockstep.cli import main as lockstep
from lockstep.observability.metrics import read_jsonl

BASE = Path(__file__).resolve().parents[1] / "examples" / "tiny-local.yaml"


def run(tmp: Path, precision: str, correction: str, steps: int) -> list[dict[str, float]]:
    doc = yaml.safe_load(BASE.read_text())
    doc["spec"]["rollout"]["precision"] = precision
    doc["spec"]["algorithm"]["mismatch"]["correction"] = correction
    doc["spec"]["schedule"].update(steps=steps, saveInterval=steps)
    doc["spec"]["schedule"].pop("evalInterval", None)
    doc["spec"]["data"].pop("evalPrompts", None)
    name = f"{precision}-{correction}"
    manifest = tmp / f"{name}.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    run_dir = tmp / name
    assert lockstep(["run", str(manifest), "--run-dir", str(run_dir), "--cache-dir", str(tmp / "cache")]) == 0
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="RL steps per run (after the SFT warm start)")
    p.add_argument("--last", type=int, default=20, help="steps whose mean reward is reported")
    args = p.parse_args()
    logging.disable(logging.INFO)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in ("bf16", "fp8"):
            for correction in ("off", "tis"):
                rows = run(Path(tmp), precision, correction, args.steps)
                results[(precision, correction)] = {
                    "diff": mean(r["train_rollout_logprob_abs_diff"] for r in rows),
                    "p99": mean(r["mismatch_ratio_p99"] for r in rows),
                    "reward": mean(r["reward_mean"] for r in rows[-args.last :]),
                }
    base = results[("bf16", "off")]
    print(
        f"tiny RL run, {args.steps} steps: rollout precision x mismatch correction (reward: last {args.last} steps)"
    )
    print(
        f"{'rollout':8} {'TIS':4} {'lp |diff|':>10} {'ratio p99':>10} {'reward':>7} {'diff/bf16':>10} {'reward/bf16':>12}"
    )
    for (precision, correction), m in results.items():
        print(
            f"{precision:8} {correction:4} {m['diff']:10.3g} {m['p99']:10.4f} {m['reward']:7.3f} "
            f"{m['diff'] / max(base['diff'], 1e-30):10.1f} {m['reward'] / max(base['reward'], 1e-9):12.3f}"
        )


if __name__ == "__main__":
    main()
