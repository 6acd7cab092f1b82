"""CPU threads figure: the example job's wall time with torch's default intra-op threads vs the shared budget.

Why it exists: `lockstep run` runs the trainer and the reference engine in one process, each calling
torch from its own thread with its own intra-op team; lockstep.driver.threads shares the cores between
them (one thread each on 2 cores) unless OMP_NUM_THREADS is set. This runs the same manifest for the
same steps twice, as shipped (the shared budget) and with OMP_NUM_THREADS = the usable cores (torch's
default, the baseline), and prints both wall and CPU times, the ratio, and whether the rewards were
identical (the budget changes speed only).

Run: `.venv/bin/python bench/cpu_threads.py [--manifest examples/tiny-local.yaml] [--steps 60]`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from seed_sweep import run_once  # bench/ is not a package: its scripts import each other by path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", type=Path, default=Path("examples/tiny-local.yaml"))
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    runs = Path(tempfile.mkdtemp())
    os.environ.pop("OMP_NUM_THREADS", None)
    shipped_rows, shipped, shipped_cpu, _ = run_once(args.manifest, runs / "shipped", args.steps)
    base_rows, base, base_cpu, _ = run_once(args.manifest, runs / "default", args.steps, threads=cores)
    same = [r.get("reward_mean") for r in shipped_rows if r.get("kind") == "train"] == [
        r.get("reward_mean") for r in base_rows if r.get("kind") == "train"
    ]
    print(f"{args.manifest}, {args.steps} RL steps, {cores} usable cores")
    print(f"baseline (torch default, {cores} threads per worker): wall {base:.1f} s, CPU {base_cpu:.1f} s")
    print(f"shipped (cores shared between the workers):      wall {shipped:.1f} s, CPU {shipped_cpu:.1f} s")
    print(f"ratio baseline/shipped: {base / shipped:.2f}x wall; same per-step rewards: {same}")


if __name__ == "__main__":
    main()
