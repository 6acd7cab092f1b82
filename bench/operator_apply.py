"""Operator latency and footprint: apply -> all pods created, for one 16-pod job and for 50 jobs at once.

Why: `kubectl apply -f rljob.yaml` should turn into pods about as fast as the API server can take
them; the operator's own overhead (watch latency, reconcile passes, status writes) is the difference.
The baseline, measured in the same run on the same control plane, is the same pods created directly
by server-side apply from one client (sequentially for the one job, 50 at a time for the 50 jobs):
the ratio operator / direct is the figure. Also the operator's resident memory when idle (after
start-up and again after the load), the number that sizes its Deployment's memory request.

Setup: a fresh local control plane (e2e/controlplane, kwok GPU nodes), the CRDs, and the operator as
a real process (`python -m lockstep_operator`, standalone). Jobs use gang scheduler none.
- one job: GB300, 8 trainer rank pods + 8 engine replicas (16 GPU pods; the driver pod is not
  counted), repeated --runs times;
- 50 jobs: CPU jobs of 1 engine + 1 trainer rank + 1 driver (3 pods each, 150 pods), applied
  concurrently; per-job apply -> its 3 pods exist.

Run from the repository root:  .venv/bin/python bench/operator_apply.py [--runs 5] [--jobs 50]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo root, for `e2e`

from lockstep_operator.k8s.client import KubeClient, load_credentials  # noqa: E402

from e2e.controlplane.cluster import ControlPlane, find_binaries  # noqa: E402

JOB_LABEL = "rl.lockstep.dev/job"
METRICS_PORT = 19391


def rljob(name: str, *, big: bool) -> dict[str, Any]:
    base: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-local.yaml").read_text())
    base["metadata"] = {"name": name}
    spec = base["spec"]
    spec["placement"] = {"gang": {"scheduler": "none"}}
    spec["weightSync"]["checkWeightUpdateEqual"] = False
    if big:
        spec["placement"]["gpuProduct"] = "GB300"
        spec["trainer"].update({"device": "cuda", "nodes": 8, "gpusPerNode": 4})
        spec["rollout"].update({"replicas": 8, "gpusPerEngine": 4})
    return base


def scrape() -> dict[str, float]:
    """The operator's Prometheus series (name{labels} -> value)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def count_pods(kube: KubeClient, ns: str, roles: tuple[str, ...]) -> dict[str, int]:
    """Pods per job in `ns` (only the given roles)."""
    counts: dict[str, int] = {}
    for pod in await kube.list("v1", "Pod", ns):
        labels = pod["metadata"].get("labels") or {}
        if labels.get("rl.lockstep.dev/role") in roles and not pod["metadata"].get("deletionTimestamp"):
            counts[labels[JOB_LABEL]] = counts.get(labels[JOB_LABEL], 0) + 1
    return counts


async def apply_and_time(
    kube: KubeClient, ns: str, jobs: list[dict[str, Any]], want: int, roles: tuple[str, ...]
) -> dict[str, float]:
    """Apply every job at once; seconds from the apply until each job has `want` pods of `roles`."""
    started = time.perf_counter()
    await asyncio.gather(*(kube.apply({**j, "metadata": {**j["metadata"], "namespace": ns}}) for j in jobs))
    done: dict[str, float] = {}
    while len(done) < len(jobs):
        counts = await count_pods(kube, ns, roles)
        now = time.perf_counter() - started
        for job in jobs:
            name = job["metadata"]["name"]
            if name not in done and counts.get(name, 0) >= want:
                done[name] = now
        if now > 300:
            raise TimeoutError(f"only {len(done)}/{len(jobs)} jobs got their pods in 300 s")
        await asyncio.sleep(0.02)
    return done


async def clear(kube: KubeClient, ns: str) -> None:
    """Delete every RLJob and bare pod of the namespace and wait until no pod is left."""
    for job in await kube.list("rl.lockstep.dev/v1alpha1", "RLJob", ns):
        await kube.delete("rl.lockstep.dev/v1alpha1", "RLJob", ns, job["metadata"]["name"])
    for pod in await kube.list("v1", "Pod", ns):
        await kube.delete("v1", "Pod", ns, pod["metadata"]["name"])
    while await kube.list("v1", "Pod", ns):
        await asyncio.sleep(0.2)


def bare(pod: dict[str, Any], ns: str) -> dict[str, Any]:
    """A pod manifest as the operator applied it, without owner and server fields (the baseline)."""
    meta = pod["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"direct-{meta['name']}",
            "namespace": ns,
            "labels": {**meta["labels"], JOB_LABEL: "direct-" + meta["labels"][JOB_LABEL]},
        },
        "spec": {
            k: v
            for k, v in pod["spec"].items()
            if k not in ("nodeName", "serviceAccountName", "serviceAccount")
        },
    }


async def direct(kube: KubeClient, manifests: list[dict[str, Any]], concurrency: int) -> float:
    """Seconds to server-side apply `manifests` directly, `concurrency` at a time."""
    sem = asyncio.Semaphore(concurrency)

    async def one(m: dict[str, Any]) -> None:
        async with sem:
            await kube.apply(m)

    started = time.perf_counter()
    await asyncio.gather(*(one(m) for m in manifests))
    return time.perf_counter() - started


async def scenarios(cp: ControlPlane, op_pid: int, runs: int, jobs: int) -> None:
    async with KubeClient(await load_credentials(str(cp.kubeconfig))) as kube:
        ns = "bench"
        await kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        while not await kube.list("v1", "ServiceAccount", ns):
            await asyncio.sleep(0.2)
        # Warm-up: the operator's watches are established and its code paths imported.
        await apply_and_time(kube, ns, [rljob("warmup", big=False)], 2, ("engine", "trainer"))
        await clear(kube, ns)
        await asyncio.sleep(5)
        idle_before = rss_mib(op_pid)

        one_job: list[float] = []
        baseline_one: list[float] = []
        for i in range(runs):
            times = await apply_and_time(kube, ns, [rljob(f"big-{i}", big=True)], 16, ("engine", "trainer"))
            one_job.append(times[f"big-{i}"])
            created = [
                p
                for p in await kube.list("v1", "Pod", ns)
                if (p["metadata"].get("labels") or {}).get("rl.lockstep.dev/role") in ("engine", "trainer")
            ]
            await clear(kube, ns)
            baseline_one.append(await direct(kube, [bare(p, ns) for p in created], 1))
            await clear(kube, ns)

        many = [rljob(f"job-{i:02d}", big=False) for i in range(jobs)]
        per_job = await apply_and_time(kube, ns, many, 3, ("engine", "trainer", "driver"))
        times_many = list(per_job.values())
        created = [
            p
            for p in await kube.list("v1", "Pod", ns)
            if p["metadata"]["labels"].get("rl.lockstep.dev/role") in ("engine", "trainer", "driver")
        ]
        await clear(kube, ns)
        baseline_many = await direct(kube, [bare(p, ns) for p in created], jobs)
        await clear(kube, ns)
        await asyncio.sleep(5)
        idle_after = rss_mib(op_pid)

    p50, p95 = statistics.median(one_job), percentile(one_job, 0.95)
    base = statistics.median(baseline_one)
    print(f"one 16-pod job ({runs} runs): apply -> 16 pods created p50 {p50:.2f} s, p95 {p95:.2f} s")
    print(f"  baseline (same 16 pods, direct server-side apply, sequential): p50 {base:.2f} s")
    print(f"  ratio operator / direct (p50): {p50 / base:.1f}x")
    m50, m95, total = statistics.median(times_many), percentile(times_many, 0.95), max(times_many)
    print(
        f"{jobs} jobs at once ({len(created)} pods): apply -> a job's pods created p50 {m50:.2f} s, p95 {m95:.2f} s, all {total:.2f} s"
    )
    print(
        f"  baseline (same {len(created)} pods, direct server-side apply, {jobs} at a time): {baseline_many:.2f} s"
    )
    print(f"  ratio operator all / direct: {total / baseline_many:.1f}x")
    series = scrape()
    passes = sum(v for k, v in series.items() if k.startswith("lockstep_operator_reconciles_total{"))
    calls = sum(v for k, v in series.items() if k.startswith("lockstep_operator_api_requests_total{"))
    n = runs + jobs + 1
    by_kind = {
        k.split("{", 1)[1].rstrip("}"): int(v)
        for k, v in series.items()
        if k.startswith("lockstep_operator_reconciles_total{")
    }
    print("  passes by kind and result: " + ", ".join(f"{k}: {v}" for k, v in sorted(by_kind.items())))
    print(
        f"operator work over the run ({n} jobs): {passes:.0f} reconcile passes, {calls:.0f} API requests "
        f"({passes / n:.0f} passes, {calls / n:.0f} requests per job)"
    )
    print(
        f"operator idle RSS: {idle_before:.0f} MiB after start-up, {idle_after:.0f} MiB after the load "
        f"(ratio to the Deployment's 128 MiB request: {idle_after / 128:.2f})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, help="repetitions of the one-job case (default 5)")
    parser.add_argument("--jobs", type=int, default=50, help="jobs applied at once (default 50)")
    args = parser.parse_args()
    load1, _, _ = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load1:.1f} before the run")
    keep = os.environ.get("LOCKSTEP_E2E_KEEP") == "1"
    with ControlPlane(bin_dir=find_binaries(), keep_work_dir=keep) as cp:
        print(f"operator log: {cp.log_dir / 'operator.log'}")
        for crd in sorted((ROOT / "crds").glob("rl.lockstep.dev_*.yaml")):
            cp.apply(crd.read_text())
        for crd in sorted((ROOT / "crds").glob("rl.lockstep.dev_*.yaml")):
            cp.kubectl(
                "wait",
                "--for=condition=Established",
                f"crd/{yaml.safe_load(crd.read_text())['metadata']['name']}",
            )
        env = {**os.environ, "KUBECONFIG": str(cp.kubeconfig), "LOCKSTEP_OPERATOR_HA_MODE": "standalone",
               "LOCKSTEP_OPERATOR_HEALTH_PORT": "0", "LOCKSTEP_OPERATOR_METRICS_PORT": str(METRICS_PORT),
               "LOCKSTEP_OPERATOR_LOG_FORMAT": "text", "LOCKSTEP_OPERATOR_LOG_LEVEL": "WARNING"}  # fmt: skip
        log = open(cp.log_dir / "operator.log", "wb")  # noqa: SIM115  (closed below)
        op = subprocess.Popen(
            [sys.executable, "-m", "lockstep_operator"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            asyncio.run(scenarios(cp, op.pid, args.runs, args.jobs))
        finally:
            op.terminate()
            op.wait(timeout=30)
            log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
