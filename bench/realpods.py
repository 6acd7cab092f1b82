"""The example RLJob on real pods: apply -> first step, apply -> Succeeded, and the per-step time in pods
against the same manifest under `lockstep run` on the same machine.

Why: the cluster path adds process boundaries `lockstep run` does not have (driver ->
trainer rank 0 over HTTP, two gloo ranks in separate pods, the engine pod over the router Service,
progress reports to the apiserver). This says what they cost on one machine. It starts a local
cluster with a real node (warm: binaries and the runtime image cached), the operator in-process,
applies examples/tiny-cluster.yaml (a hostPath ReadWriteMany volume for its claim) and follows the job
with `kubectl get rljob -w`: the time of each status change. Then it runs `lockstep run` on the same
manifest and times each `train` record as it appears in metrics.jsonl. Per-step time is the median of
step-to-step intervals after step 2 (the first steps include warm-up).

Run from the repository root, as root:
  PYTHONPATH=$PWD/runtime:$PWD/operator .venv/bin/python bench/realpods.py [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo root, for `e2e`

from e2e.controlplane.cluster import ControlPlane, find_binaries  # noqa: E402
from e2e.test_realpods import EXAMPLE, Operator, Watch, shared_volume  # noqa: E402


def median_interval(times: dict[int, float], skip: int = 2) -> float:
    """Median of t(step k) - t(step k-1) over steps after `skip` (pure)."""
    gaps = [times[k] - times[k - 1] for k in sorted(times) if k > skip and k - 1 in times]
    return statistics.median(gaps) if gaps else float("nan")


def in_pods(out: dict[str, Any]) -> None:
    import yaml

    cp = ControlPlane(bin_dir=find_binaries(), nodes_file=None, real_node=True)
    t0 = time.monotonic()
    cp.start()
    out["cluster_start_s"] = time.monotonic() - t0
    try:
        assert cp.node is not None
        t0 = time.monotonic()
        image = cp.node.runtime_image()
        out["runtime_image_s"] = time.monotonic() - t0
        os.environ["KUBECONFIG"] = str(cp.kubeconfig)
        import lockstep_operator.handlers as handlers
        from lockstep_operator.settings import OperatorSettings

        handlers.SETTINGS = OperatorSettings(
            ha_mode="standalone", runtime_image=image, engine_image=image, health_port=0, metrics_port=0
        )
        for crd in sorted((ROOT / "crds").glob("rl.lockstep.dev_*.yaml")):
            cp.apply(crd.read_text())
            name = yaml.safe_load(crd.read_text())["metadata"]["name"]
            cp.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
        cp.kubectl("create", "namespace", "bench")
        cp.wait_for(lambda: cp.kubectl("get", "sa", "default", "-n", "bench", check=False).returncode == 0)
        manifest = yaml.safe_load(EXAMPLE.read_text())
        shared_volume(cp, "bench", manifest["spec"]["weightSync"]["diskDelta"]["volumeClaim"])
        op = Operator()
        op.start()
        try:
            job = manifest["metadata"]["name"]
            t_apply = time.monotonic()
            cp.apply(manifest, namespace="bench")
            with Watch(cp, "bench", job) as watch:
                cp.wait_for(
                    lambda: (
                        (cp.get("rljob", job, "-n", "bench").get("status") or {}).get("phase")
                        in ("Succeeded", "Failed")
                    ),
                    timeout=3600,
                    what="the job finished",
                    interval=1.0,
                )
                time.sleep(2)
            samples = watch.samples
        finally:
            op.stop()
        phases: dict[str, float] = {}
        steps: dict[int, float] = {}
        for s in samples:
            if s.phase and s.phase not in phases:
                phases[s.phase] = s.t - t_apply
            if s.step is not None and s.step not in steps:
                steps[s.step] = s.t - t_apply
        out["pods_phase_at_s"] = phases
        out["pods_final_phase"] = samples[-1].phase if samples else None
        out["pods_final_reward"] = samples[-1].reward if samples else None
        out["pods_apply_to_first_step_s"] = steps.get(1)
        out["pods_apply_to_succeeded_s"] = phases.get("Succeeded")
        out["pods_step_s"] = median_interval(steps)
    finally:
        cp.stop()


def local_run(out: dict[str, Any]) -> None:
    """`lockstep run` of the same manifest; the time each `train` record appears in metrics.jsonl."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        metrics = run_dir / "metrics.jsonl"
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "lockstep", "run", str(EXAMPLE), "--run-dir", str(run_dir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        steps: dict[int, float] = {}
        reward = None
        while proc.poll() is None:
            if metrics.exists():
                for line in metrics.read_text().splitlines():
                    rec = json.loads(line)
                    if rec["kind"] == "train" and rec["step"] not in steps:
                        steps[rec["step"]] = time.monotonic() - t0
                        reward = rec.get("reward_mean")
            time.sleep(0.05)
        out["local_exit"] = proc.returncode
        out["local_total_s"] = time.monotonic() - t0
        out["local_first_step_s"] = steps.get(1)
        out["local_step_s"] = median_interval(steps)
        out["local_last_reward"] = reward


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=None, help="write <out>/realpods_<date>_cpu.json")
    parser.add_argument("--skip-local", action="store_true", help="only the pods")
    args = parser.parse_args()
    out: dict[str, Any] = {"date": dt.date.today().isoformat(), "load_before": os.getloadavg()[0]}
    in_pods(out)
    if not args.skip_local:
        local_run(out)
        out["step_overhead_ratio"] = out["pods_step_s"] / out["local_step_s"]
    out["load_after"] = os.getloadavg()[0]
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"realpods_{out['date']}_cpu.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
