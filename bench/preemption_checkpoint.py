"""Figure: time from SIGTERM to a durable checkpoint, on the example, next to the checkpoint's own write.

Why it exists: a preempted GPU gives 30-120 s of notice (spec.schedule.preemptionGraceSeconds is the
pods' grace period); the driver must reach a safe point and write the checkpoint inside it
(lockstep.driver.preemption). This runs the example as `lockstep run` would (a real process), sends
SIGTERM after a random number of steps (so it lands in a rollout or in a train step), and reads the
`preemption` row of metrics.jsonl: seconds from SIGTERM to the durable checkpoint, and of those, the
seconds writing the checkpoint. The baseline, measured in the same run, is that write: the ratio is
what reaching the safe point adds. Each trial also counts the steps it trained that the checkpoint
lacks (lost steps; goal 0). Resuming from that checkpoint is runtime/tests/driver/test_preemption.py's.

Run: `.venv/bin/python bench/preemption_checkpoint.py [--manifest examples/tiny-local.yaml] [--trials 3]`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from lockstep.observability.metrics import read_jsonl
from lockstep.trainer.state import latest_checkpoint


def _run(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("a") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "lockstep", "run", *args],
            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
            stdout=out,
            stderr=out,
        )


def _trial(manifest: Path, work: Path, cache: Path, kill_after: int, steps: int) -> dict[str, float]:
    run_dir, log = work / "run", work / "run.log"
    args = [str(manifest), "--run-dir", str(run_dir), "--cache-dir", str(cache), "--steps", str(steps)]
    proc = _run(args, log)
    while len(read_jsonl(run_dir / "metrics.jsonl", "train", raw=True)) < kill_after:
        if proc.poll() is not None:
            raise SystemExit(f"the run ended before step {kill_after}: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    time.sleep(random.uniform(0.0, 1.0))  # land anywhere in the next step
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=600)
    [row] = read_jsonl(run_dir / "metrics.jsonl", "preemption")
    trained = max(r["step"] for r in read_jsonl(run_dir / "metrics.jsonl", "train"))
    checkpoint = latest_checkpoint(run_dir)
    saved = json.loads((checkpoint / "trainer_state.json").read_text())["extra"]["step"] if checkpoint else -1
    return {
        "exit": float(code),
        "sigterm_to_checkpoint_s": row["sigterm_to_checkpoint_s"],
        "checkpoint_write_s": row.get("checkpoint_write_s", float("nan")),
        "steps_trained": float(trained),
        "steps_saved": float(saved),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest", type=Path, default=Path("examples/tiny-local.yaml"))
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12, help="--steps of each run (SIGTERM comes before)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    random.seed(args.seed)
    doc = yaml.safe_load(args.manifest.read_text())
    doc["spec"]["schedule"].pop("saveInterval", None)  # only the SIGTERM checkpoint saves the steps
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        manifest = Path(tmp) / "job.yaml"
        manifest.write_text(yaml.safe_dump(doc))
        for t in range(args.trials):
            work = Path(tmp) / f"trial{t}"
            work.mkdir()
            kill_after = random.randint(2, max(args.steps - 4, 2))
            r = _trial(manifest, work, cache, kill_after, args.steps)
            rows.append(r)
            print(
                f"trial {t}: SIGTERM after step {kill_after}: exit {r['exit']:.0f}, SIGTERM -> checkpoint "
                f"{r['sigterm_to_checkpoint_s']:.2f} s (writing it {r['checkpoint_write_s']:.2f} s), "
                f"steps trained {r['steps_trained']:.0f}, saved {r['steps_saved']:.0f}",
                flush=True,
            )
    total = statistics.median(r["sigterm_to_checkpoint_s"] for r in rows)
    write = statistics.median(r["checkpoint_write_s"] for r in rows)
    lost = sum(r["steps_trained"] - r["steps_saved"] for r in rows)
    grace = doc["spec"]["schedule"].get("preemptionGraceSeconds", 120)
    print(f"\n{args.manifest} ({len(rows)} trials): median SIGTERM -> durable checkpoint {total:.2f} s, "
          f"of which writing it {write:.2f} s; grace period {grace} s")  # fmt: skip
    print(f"ratio to baseline (the checkpoint write alone): x{total / write:.2f}; steps lost: {lost:.0f}")


if __name__ == "__main__":
    main()
