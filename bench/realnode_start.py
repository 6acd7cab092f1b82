"""Time to a ready local cluster with a real node, and to a first real pod, against the kwok-only start.

Why: the real node (kubelet, containerd, kube-proxy, CoreDNS in their own namespaces)
is paid once per test session that uses it. Runs N warm starts (binaries and images cached) of
`ControlPlane(nodes_file=None)` (the baseline, measured in the same run) and of the same with
`real_node=True`, then applies a busybox pod that prints one line and times apply -> Succeeded.
Prints the p50s and the ratio of each to the baseline, and what the NetworkPolicy enforcer (kube-router,
started after the rest of the node is ready) adds to the start. With --build-log it also reports the cold
build of the node binaries from a log of `time bash e2e/controlplane/node/build.sh`.

Run from the repository root, as root:  .venv/bin/python bench/realnode_start.py [--runs 3] [--build-log F]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `e2e`

from e2e.controlplane.cluster import ControlPlane, find_binaries
from e2e.controlplane.realnode import pod_manifest


def first_pod_seconds(cp: ControlPlane) -> float:
    """apply -> Succeeded of a one-line busybox pod on the real node (image already imported)."""
    assert cp.node is not None
    cp.kubectl("create", "namespace", "bench")
    cp.wait_for(
        lambda: cp.kubectl("get", "sa", "default", "-n", "bench", check=False).returncode == 0, timeout=60
    )
    t0 = time.monotonic()
    cp.apply(pod_manifest("first", cp.node.images["busybox"], ["echo", "hello"]), namespace="bench")
    cp.wait_for(
        lambda: cp.get("pod", "first", "-n", "bench")["status"].get("phase") == "Succeeded",
        timeout=300,
        what="the first pod Succeeded",
        interval=0.1,
    )
    return time.monotonic() - t0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="warm starts of each kind (default 3)")
    parser.add_argument(
        "--build-log", type=Path, help="log of a cold `time bash e2e/controlplane/node/build.sh`"
    )
    args = parser.parse_args()

    if args.build_log:
        text = args.build_log.read_text()
        per = {m.group(1): int(m.group(2)) for m in re.finditer(r"^built (\S+) in (\d+) s$", text, re.M)}
        print("cold node build: " + ", ".join(f"{k} {v} s" for k, v in per.items()))

    bin_dir = find_binaries()
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} before the runs")
    base, real, pod, netpol = [], [], [], []
    for i in range(args.runs):
        with ControlPlane(bin_dir=bin_dir, nodes_file=None) as cp:
            base.append(cp.milestones["ready"])
        cp = ControlPlane(bin_dir=bin_dir, nodes_file=None, real_node=True)
        with cp:
            real.append(cp.milestones["ready"])
            assert cp.node is not None
            node = dict(cp.node.milestones)
            netpol.append(node["netpol"] - node["ready"])
            pod.append(first_pod_seconds(cp))
        print(
            f"run {i + 1}: kwok-only ready {base[-1]:.1f} s; with real node ready {real[-1]:.1f} s "
            f"(node: containerd {node['containerd']:.1f} s, kubelet Ready {node['kubelet']:.1f} s, "
            f"all but kube-router {node['ready']:.1f} s, kube-router {netpol[-1]:.1f} s more); "
            f"first pod apply -> Succeeded {pod[-1]:.1f} s"
        )
    b, r, p, n = (statistics.median(x) for x in (base, real, pod, netpol))
    print(f"p50 kwok-only control plane ready (baseline): {b:.1f} s")
    print(f"p50 with a real node ready: {r:.1f} s = {r / b:.2f} x the baseline")
    print(
        f"p50 added by the NetworkPolicy enforcer (kube-router ready): {n:.1f} s = {n / r:.2f} x the real-node start"
    )
    print(f"p50 first real pod apply -> Succeeded: {p:.1f} s = {p / b:.2f} x the baseline")
    print(f"load average after the runs: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
