"""Warm start time of the local e2e control plane, against the 15 s target.

Why: every e2e session pays this start once; the target is apiserver ready within 15 s on a warm
machine (binaries cached). Runs N starts (default 3) of e2e.controlplane.cluster.ControlPlane with the
default nodes, prints each run's milestones and the p50 of "apiserver ready" and "all ready", each as
a ratio to the 15 s target. With --build-log it also reports the cold build time from a log of
`time bash e2e/controlplane/build.sh` (per-binary "built X in N s" lines and bash's `real` line).

Run from the repository root:  .venv/bin/python bench/controlplane_start.py [--runs 3] [--build-log F]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `e2e`

from e2e.controlplane.cluster import ControlPlane, find_binaries

TARGET_S = 15.0
MILESTONES = ("etcd", "apiserver", "controllers", "nodes", "ready")


def cold_build(log: Path) -> tuple[dict[str, int], float | None]:
    """Per-binary build seconds and the total wall time (bash `time` output) from a build log."""
    text = log.read_text()
    per = {m.group(1): int(m.group(2)) for m in re.finditer(r"^built (\S+) in (\d+) s$", text, re.M)}
    real = re.search(r"^real\s+(\d+)m([\d.]+)s$", text, re.M)
    total = int(real.group(1)) * 60 + float(real.group(2)) if real else None
    return per, total


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="number of warm starts (default 3)")
    parser.add_argument("--build-log", type=Path, help="log of a cold `time bash e2e/controlplane/build.sh`")
    args = parser.parse_args()

    if args.build_log:
        per, total = cold_build(args.build_log)
        print(f"cold build ({args.build_log}): " + ", ".join(f"{k} {v} s" for k, v in per.items()))
        if total is not None:
            print(f"cold build total: {total:.0f} s wall ({total / 60:.1f} min)")

    bin_dir = find_binaries()
    load1, _, _ = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load1:.1f} before the runs")
    runs: list[dict[str, float]] = []
    for i in range(args.runs):
        cp = ControlPlane(bin_dir=bin_dir)
        with cp:
            nodes = len(cp.api_get("/api/v1/nodes")["items"])
        runs.append(dict(cp.milestones))
        print(
            f"run {i + 1}: "
            + "  ".join(f"{k} {cp.milestones[k]:.2f} s" for k in MILESTONES)
            + f"  ({nodes} nodes)"
        )

    for key, label in (
        ("apiserver", "apiserver ready"),
        ("ready", "all ready (controllers, scheduler, kwok, nodes)"),
    ):
        p50 = statistics.median(r[key] for r in runs)
        print(f"warm start p50, {label}: {p50:.2f} s = {p50 / TARGET_S:.2f} x the {TARGET_S:.0f} s target")
    print(f"load average after the runs: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
