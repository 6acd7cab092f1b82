"""Operator latency and footprint: apply -> all pods created, for one 16-pod job and for 50 jobs at once.

Why: `kubectl apply -f rljob.yaml` should turn into pods about as fast as the API server can take
them; the operator's own overhead (watch latency, reconcile passes, status writes) is the difference.
The baseline, measured in the same run on the same control plane, is the same pods created directly
by server-side apply from one client (sequentially for the one job, 50 at a time for the 50 jobs),
and for the 50 jobs also by plain create (POST, what the operator sends for a new pod, cheaper for
the API server); the ratio operator / the faster of the two is the figure. Each burst also times its floor: the
writes on the operator's path to the pods (per job two ServiceAccounts, then the RolloutPool, the
TrainerGroup and the driver pod, then the engine and trainer pods, as the operator made them),
made directly by one client with the operator stopped; floor / direct is what those writes cost the
API server, operator / floor what the operator adds (its passes, watch hops and other requests).
Also the operator's
resident memory when idle (after start-up and again after the load), the number that sizes its
Deployment's memory request.

Setup: a fresh local control plane (e2e/controlplane, kwok GPU nodes), the CRDs, and the operator as
a real process (`python -m lockstep_operator`, standalone). Jobs use gang scheduler none.
- one job: GB300, 8 trainer rank pods + 8 engine replicas (16 GPU pods; the driver pod is not
  counted), repeated --runs times;
- 50 jobs: CPU jobs of 1 engine + 1 trainer rank + 1 driver (3 pods each, 150 pods), applied
  concurrently, --bursts times, each burst followed by its own baseline (the median of the ratios is
  the figure: single bursts on shared cores vary by 2x); per-job apply -> its 3 pods exist (as one pod
  watch sees them appear); also apply -> every job's ConfigMaps, Secret,
  Services, RBAC and NetworkPolicies exist (the operator creates them after the pods: docs/operator.md,
  "Reconcile order"), the window of the CPU and request counts. Then, with those jobs present, the operator's RSS
  and mean CPU over STEADY_S (`--jobs 200`: the footprint at 200 RLJobs that sizes its Deployment).

--split-cores: the control plane (API server, etcd, scheduler, controller manager, kwok) on CPU 0, the
operator and the bench's own client (so the direct baseline too) on CPU 1, as in a cluster, where the
operator runs on a worker node and does not take the API server's cores. Without it every process
shares both cores, and the operator's own CPU (about 5 s per 50-job burst) is CPU the API server
lacks, which the direct baseline's one client barely takes.

Run from the repository root:  .venv/bin/python bench/operator_apply.py [--runs 5] [--jobs 50] [--bursts 3]
(--profile PATH: the operator runs under cProfile, its stats written to PATH when it stops;
LOCKSTEP_PROFILE_APISERVER=1: kube-apiserver serves /debug/pprof, e.g. `kubectl --kubeconfig
/tmp/lockstep-cp-*/kubeconfig get --raw '/debug/pprof/profile?seconds=12' > cpu.prof` during a burst,
then `go tool pprof -top -cum cpu.prof`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import threading
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


def _memory_request_mib() -> float:
    """The operator Deployment's memory request (manifests/deployment.yaml), in MiB."""
    for doc in yaml.safe_load_all((ROOT / "manifests" / "deployment.yaml").read_text()):
        if doc and doc.get("kind") == "Deployment":
            raw = str(doc["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"])
            return (
                float(raw.removesuffix("Mi")) if raw.endswith("Mi") else float(raw.removesuffix("Gi")) * 1024
            )
    raise SystemExit("manifests/deployment.yaml has no Deployment: the memory request cannot be compared")


REQUEST_MIB = _memory_request_mib()
PROFILED = """
import cProfile, runpy, time
profile = cProfile.Profile(time.process_time)  # CPU time: what a loaded machine does not inflate
profile.enable()
try:
    runpy.run_module("lockstep_operator", run_name="__main__")
except SystemExit:
    pass
finally:
    profile.disable()
    profile.dump_stats({path!r})
"""
"""The operator's command with --profile: `python -m lockstep_operator` under cProfile (CPU time)."""
STEADY_S = 75.0
"""Seconds the operator's CPU and requests are measured over with the burst's jobs present: longer
than one resync period (60 s), so every job's periodic re-check falls in it."""


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


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class PodWatch:
    """Every pod's first appearance in `ns`, timestamped from one watch (the maintained `kubernetes`
    client, in a thread). Why a watch: polling the pod list every 20 ms, as this bench once did, is 50
    LISTs a second of API-server CPU during the operator's burst and none during the direct baseline's."""

    def __init__(self, kubeconfig: str, ns: str) -> None:
        import kubernetes

        self.ns = ns
        self.api = kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(kubeconfig))
        self.seen: dict[str, tuple[float, dict[str, str]]] = {}  # pod uid -> (perf_counter, labels)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-pod-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import kubernetes

        version = ""
        while not self.stop.is_set():
            watch = kubernetes.watch.Watch()
            try:
                for event in watch.stream(
                    self.api.list_namespaced_pod, self.ns, resource_version=version, timeout_seconds=5
                ):
                    meta = event["object"].metadata
                    version = meta.resource_version
                    if event["type"] == "ADDED" and meta.uid not in self.seen:
                        self.seen[meta.uid] = (time.perf_counter(), dict(meta.labels or {}))
                    if self.stop.is_set():
                        break
            except kubernetes.client.ApiException as e:
                if e.status != 410:
                    raise
                version = ""  # expired: list again (every pod then comes as ADDED, first times kept)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)

    def counts(self, roles: tuple[str, ...], since: float) -> dict[str, tuple[int, float]]:
        """Per job: how many pods of `roles` appeared after `since`, and when the last of them did."""
        out: dict[str, tuple[int, float]] = {}
        for at, labels in list(self.seen.values()):
            if at >= since and labels.get("rl.lockstep.dev/role") in roles and JOB_LABEL in labels:
                n, last = out.get(labels[JOB_LABEL], (0, 0.0))
                out[labels[JOB_LABEL]] = (n + 1, max(last, at))
        return out


async def apply_and_time(
    kube: KubeClient, watch: PodWatch, ns: str, jobs: list[dict[str, Any]], want: int, roles: tuple[str, ...]
) -> dict[str, float]:
    """Apply every job at once; seconds from the apply until each job has `want` pods of `roles`, as the
    pod watch saw them appear."""
    started = time.perf_counter()
    await asyncio.gather(*(kube.apply({**j, "metadata": {**j["metadata"], "namespace": ns}}) for j in jobs))
    names = [j["metadata"]["name"] for j in jobs]
    while True:
        counts = watch.counts(roles, started)
        if all(counts.get(n, (0, 0.0))[0] >= want for n in names):
            return {n: counts[n][1] - started for n in names}
        if time.perf_counter() - started > 300:
            done = sum(counts.get(n, (0, 0.0))[0] >= want for n in names)
            raise TimeoutError(f"only {done}/{len(jobs)} jobs got their pods in 300 s")
        await asyncio.sleep(0.02)


SUPPORTING = (
    ("v1", "ConfigMap"),
    ("v1", "Secret"),
    ("v1", "Service"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
)
"""What a job's pods need once they run, which the operator creates after them (docs/operator.md,
"Reconcile order")."""


async def supporting(kube: KubeClient, ns: str) -> dict[str, int]:
    """Objects of SUPPORTING per job in `ns` (by the job label)."""
    counts: dict[str, int] = {}
    for api_version, kind in SUPPORTING:
        for obj in await kube.list(api_version, kind, ns, selector=JOB_LABEL):
            job = obj["metadata"]["labels"][JOB_LABEL]
            counts[job] = counts.get(job, 0) + 1
    return counts


async def supporting_done(kube: KubeClient, ns: str, names: list[str], want: int, started: float) -> float:
    """Seconds from `started` until every job of `names` has its `want` supporting objects."""
    while True:
        counts = await supporting(kube, ns)
        if all(counts.get(n, 0) >= want for n in names):
            return time.perf_counter() - started
        if time.perf_counter() - started > 300:
            raise TimeoutError("the jobs' ConfigMaps, Secrets, RBAC, Services and policies took over 300 s")
        await asyncio.sleep(0.2)


async def clear(kube: KubeClient, ns: str) -> None:
    """Delete every RLJob and bare pod of the namespace and wait until no pod, no child and no supporting
    object is left: the garbage collector's deletions would otherwise load the API server during the
    next measurement (a baseline taken meanwhile came out up to 2.6x slower)."""
    for job in await kube.list("rl.lockstep.dev/v1alpha1", "RLJob", ns):
        await kube.delete("rl.lockstep.dev/v1alpha1", "RLJob", ns, job["metadata"]["name"])
    for pod in await kube.list("v1", "Pod", ns):
        await kube.delete("v1", "Pod", ns, pod["metadata"]["name"])
    children = ("RolloutPool", "TrainerGroup", "WeightChannel")
    while (
        await kube.list("v1", "Pod", ns)
        or await supporting(kube, ns)
        or await kube.list("v1", "ServiceAccount", ns, selector=JOB_LABEL)
        or any([await kube.list("rl.lockstep.dev/v1alpha1", kind, ns) for kind in children])
    ):
        await asyncio.sleep(0.2)
    await quiet()


async def quiet(still_s: float = 3.0, most_s: float = 60.0) -> None:
    """Wait until the operator has run no pass for `still_s` (at most `most_s`): the deletions' events
    and passes of what was cleared end before the next measurement starts (without this wait, bursts
    after the first took up to twice as long as the first)."""
    end, last = time.monotonic() + most_s, _passes(scrape())
    while time.monotonic() < end:
        await asyncio.sleep(still_s)
        now = _passes(scrape())
        if now == last:
            return
        last = now


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


async def direct(
    kube: KubeClient, manifests: list[dict[str, Any]], concurrency: int, *, create: bool = False
) -> float:
    """Seconds to server-side apply (`create`: POST) `manifests` directly, `concurrency` at a time."""
    sem = asyncio.Semaphore(concurrency)

    async def one(m: dict[str, Any]) -> None:
        async with sem:
            await (kube.create(m) if create else kube.apply(m))

    started = time.perf_counter()
    await asyncio.gather(*(one(m) for m in manifests))
    return time.perf_counter() - started


FLOOR_PREFIX = "floor-"
SUSPENDED = "rl.lockstep.dev/suspended"


def _floor_meta(meta: dict[str, Any], ns: str) -> dict[str, Any]:
    """A captured object's name, labels and annotations under the floor's prefix, without the job
    label (the operator's pod selector: its stopped watches then carry none of the floor's pods)."""
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k != JOB_LABEL}
    out = {"name": FLOOR_PREFIX + meta["name"], "namespace": ns, "labels": labels}
    return {**out, "annotations": meta["annotations"]} if meta.get("annotations") else out


def floor_chains(captured: dict[str, list[dict[str, Any]]], ns: str) -> list[list[list[dict[str, Any]]]]:
    """Per job, the writes on the operator's path to its pods, as the operator made them and in its
    order (docs/operator.md, "Reconcile order"): the two ServiceAccounts; then the RolloutPool, the
    TrainerGroup and the driver pod; then the engine and the trainer pod (each made by its pool's or
    trainer group's pass). Names prefixed, owners and server fields dropped."""
    chains: dict[str, list[list[dict[str, Any]]]] = {}
    accounts = {a["metadata"]["name"] for a in captured.get("ServiceAccount", [])}
    for kind, objs in captured.items():
        for obj in objs:
            meta = obj["metadata"]
            m: dict[str, Any] = {
                "apiVersion": obj["apiVersion"],
                "kind": kind,
                "metadata": _floor_meta(meta, ns),
            }
            if kind == "Pod":
                m["spec"] = {k: v for k, v in obj["spec"].items() if k not in ("nodeName", "serviceAccount")}
                if m["spec"].get("serviceAccountName") in accounts:  # one of the job's own
                    m["spec"]["serviceAccountName"] = FLOOR_PREFIX + m["spec"]["serviceAccountName"]
            elif "spec" in obj:
                m["spec"] = obj["spec"]
                # Suspended (the same bytes but one value): the operator, once resumed, sees these
                # objects' events before their deletions and makes no pods for them.
                m["metadata"]["annotations"] = {**m["metadata"].get("annotations", {}), SUSPENDED: "true"}
            if "automountServiceAccountToken" in obj:
                m["automountServiceAccountToken"] = obj["automountServiceAccountToken"]
            chains.setdefault(meta["labels"][JOB_LABEL], [[], [], []])[_floor_step(kind, meta)].append(m)
    return list(chains.values())


def _floor_step(kind: str, meta: dict[str, Any]) -> int:
    """0: ServiceAccounts; 1: the pool, the trainer group, the driver pod; 2: engine and trainer pods."""
    if kind == "ServiceAccount":
        return 0
    return 2 if kind == "Pod" and meta["labels"].get("rl.lockstep.dev/role") in ("engine", "trainer") else 1


async def floor(kube: KubeClient, chains: list[list[list[dict[str, Any]]]], concurrency: int) -> float:
    """Seconds to make every chain's writes directly (POST), all chains at once, each step after the
    one before, at most `concurrency` requests in flight: the API server's share of the operator's
    path, with no operator in it (no watch hops, no passes, no supporting objects)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(m: dict[str, Any]) -> None:
        async with sem:
            await kube.create(m)

    async def chain(steps: list[list[dict[str, Any]]]) -> None:
        for step in steps:
            await asyncio.gather(*(one(m) for m in step))

    started = time.perf_counter()
    await asyncio.gather(*(chain(c) for c in chains))
    return time.perf_counter() - started


async def clear_floor(kube: KubeClient, chains: list[list[list[dict[str, Any]]]]) -> None:
    """Delete the floor's objects and wait until they are gone."""
    made = [m for c in chains for step in c for m in step]
    for m in made:
        await kube.delete(m["apiVersion"], m["kind"], m["metadata"]["namespace"], m["metadata"]["name"])
    for m in made:
        while await kube.get(m["apiVersion"], m["kind"], m["metadata"]["namespace"], m["metadata"]["name"]):
            await asyncio.sleep(0.2)


CAPTURED = (
    ("v1", "ServiceAccount"),
    ("rl.lockstep.dev/v1alpha1", "RolloutPool"),
    ("rl.lockstep.dev/v1alpha1", "TrainerGroup"),
)
"""Besides the pods: the objects the floor makes (what the operator writes on its path to them)."""


async def scenarios(cp: ControlPlane, op_pid: int, runs: int, jobs: int, bursts: int) -> None:
    ns = "bench"
    async with KubeClient(await load_credentials(str(cp.kubeconfig))) as kube:
        await kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        while not await kube.list("v1", "ServiceAccount", ns):
            await asyncio.sleep(0.2)
        watch = PodWatch(str(cp.kubeconfig), ns)
        try:
            await _scenarios(cp, kube, watch, ns, op_pid, runs, jobs, bursts)
        finally:
            watch.close()


async def burst(
    cp: ControlPlane,
    kube: KubeClient,
    watch: PodWatch,
    ns: str,
    op_pid: int,
    jobs: int,
    want: int,
    tag: str,
    *,
    steady: bool,
) -> dict[str, Any]:
    """`jobs` RLJobs applied at once, then the same pods created directly (the baseline, after the
    garbage collector is done): the times, and the burst's CPU, requests and counters."""
    many = [rljob(f"{tag}job-{i:02d}", big=False) for i in range(jobs)]
    watched = {"operator": op_pid, "kube-apiserver": cp.pids["kube-apiserver"], "etcd": cp.pids["etcd"]}
    cpu_before = {k: cpu_s(p) for k, p in watched.items()}
    before = scrape()
    started = time.perf_counter()
    per_job = await apply_and_time(kube, watch, ns, many, 3, ("engine", "trainer", "driver"))
    support_s = await supporting_done(kube, ns, [j["metadata"]["name"] for j in many], want, started)
    out: dict[str, Any] = {
        "times": list(per_job.values()),
        "support_s": support_s,
        "cpu": {k: cpu_s(p) - cpu_before[k] for k, p in watched.items()},
        "during": {k: v - before.get(k, 0.0) for k, v in scrape().items()},
    }
    # Steady state with the jobs present (their pods never run on kwok: the operator keeps watching
    # and resyncing them): what sizes the Deployment's requests.
    if steady:
        cpu0, t0, series0 = cpu_s(op_pid), time.monotonic(), scrape()
        await asyncio.sleep(STEADY_S)
        out["steady_mcpu"] = 1000 * (cpu_s(op_pid) - cpu0) / (time.monotonic() - t0)
        series1 = scrape()
        out["steady_calls"] = _calls(series1) - _calls(series0)
        out["steady_by"] = {
            k.split("{", 1)[1].rstrip("}"): int(v - series0.get(k, 0.0))
            for k, v in series1.items()
            if k.startswith("lockstep_operator_api_requests_total{") and v - series0.get(k, 0.0)
        }
        out["loaded_rss"] = rss_mib(op_pid)
    created = [
        p
        for p in await kube.list("v1", "Pod", ns)
        if p["metadata"]["labels"].get("rl.lockstep.dev/role") in ("engine", "trainer", "driver")
    ]
    out["pods"] = len(created)
    captured = {"Pod": [{**p, "apiVersion": "v1"} for p in created]}  # a list's items name neither
    for api_version, kind in CAPTURED:
        captured[kind] = [
            {**o, "apiVersion": api_version}
            for o in await kube.list(api_version, kind, ns)
            if JOB_LABEL in (o["metadata"].get("labels") or {})
        ]
    await clear(kube, ns)
    out["direct_apply"] = await direct(kube, [bare(p, ns) for p in created], jobs)
    await clear(kube, ns)
    out["direct_create"] = await direct(kube, [bare(p, ns) for p in created], jobs, create=True)
    await clear(kube, ns)
    out["direct"] = min(out["direct_apply"], out["direct_create"])  # the faster: the stricter baseline
    # The floor, with the operator stopped (SIGSTOP): it must not reconcile the floor's RolloutPools
    # and TrainerGroups; it resumes once they are gone and sees only their events.
    chains = floor_chains(captured, ns)
    os.kill(op_pid, signal.SIGSTOP)
    try:
        out["floor"] = await floor(kube, chains, jobs)
        await clear_floor(kube, chains)
    finally:
        os.kill(op_pid, signal.SIGCONT)
    await quiet()
    return out


async def _scenarios(
    cp: ControlPlane,
    kube: KubeClient,
    watch: PodWatch,
    ns: str,
    op_pid: int,
    runs: int,
    jobs: int,
    bursts: int,
) -> None:
    # Warm-up: the operator's watches are established and its code paths imported.
    await apply_and_time(kube, watch, ns, [rljob("warmup", big=False)], 2, ("engine", "trainer"))
    await supporting_done(kube, ns, ["warmup"], 1, time.perf_counter())
    await asyncio.sleep(2)
    want = (await supporting(kube, ns))["warmup"]  # a job's supporting objects, all made by now
    await clear(kube, ns)
    await asyncio.sleep(5)
    idle_before = rss_mib(op_pid)

    one_job: list[float] = []
    baseline_one: list[float] = []
    for i in range(runs):
        times = await apply_and_time(
            kube, watch, ns, [rljob(f"big-{i}", big=True)], 16, ("engine", "trainer")
        )
        one_job.append(times[f"big-{i}"])
        created = [
            p
            for p in await kube.list("v1", "Pod", ns)
            if (p["metadata"].get("labels") or {}).get("rl.lockstep.dev/role") in ("engine", "trainer")
        ]
        await clear(kube, ns)
        baseline_one.append(await direct(kube, [bare(p, ns) for p in created], 1))
        await clear(kube, ns)

    results = [
        await burst(cp, kube, watch, ns, op_pid, jobs, want, f"b{b}-" if b else "", steady=b == 0)
        for b in range(bursts)
    ]
    await asyncio.sleep(5)
    idle_after = rss_mib(op_pid)

    p50, p95 = statistics.median(one_job), percentile(one_job, 0.95)
    base = statistics.median(baseline_one)
    print(f"one 16-pod job ({runs} runs): apply -> 16 pods created p50 {p50:.2f} s, p95 {p95:.2f} s")
    print(f"  baseline (same 16 pods, direct server-side apply, sequential): p50 {base:.2f} s")
    print(f"  ratio operator / direct (p50): {p50 / base:.1f}x")
    for b, r in enumerate(results):
        times = r["times"]
        m50, m95, total = statistics.median(times), percentile(times, 0.95), max(times)
        print(
            f"{jobs} jobs at once, burst {b + 1}/{bursts} ({r['pods']} pods): apply -> a job's pods created "
            f"p50 {m50:.2f} s, p95 {m95:.2f} s, all {total:.2f} s; the same pods created directly, {jobs} at "
            f"a time: server-side apply {r['direct_apply']:.2f} s, create {r['direct_create']:.2f} s; ratio "
            f"to the faster {total / r['direct']:.1f}x; CPU s operator "
            f"{r['cpu']['operator']:.1f}, kube-apiserver {r['cpu']['kube-apiserver']:.1f}; "
            f"{_passes(r['during']):.0f} passes; every supporting object {r['support_s']:.1f} s; "
            f"floor {r['floor']:.2f} s"
        )
    ratios = sorted(max(r["times"]) / r["direct"] for r in results)
    print(
        f"  ratio operator all / direct over {bursts} bursts: median {statistics.median(ratios):.1f}x "
        f"(min {ratios[0]:.1f}x, max {ratios[-1]:.1f}x)"
    )
    shares = {
        "floor / direct (the path's writes alone)": [r["floor"] / r["direct"] for r in results],
        "operator all / floor (the operator's own share)": [max(r["times"]) / r["floor"] for r in results],
    }
    for name, values in shares.items():
        values = sorted(values)
        print(
            f"  ratio {name} over {bursts} bursts: median {statistics.median(values):.1f}x "
            f"(min {values[0]:.1f}x, max {values[-1]:.1f}x)"
        )
    print_burst_details(results[0], jobs, want)
    series = scrape()
    passes = sum(v for k, v in series.items() if k.startswith("lockstep_operator_reconciles_total{"))
    calls = _calls(series)
    n = runs + jobs * bursts + 1
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
        f"with the {jobs} jobs present: operator RSS {results[0]['loaded_rss']:.0f} MiB, CPU "
        f"{results[0]['steady_mcpu']:.0f} millicores (mean over {STEADY_S:.0f} s after the first burst), "
        f"{results[0]['steady_calls']:.0f} API requests in those {STEADY_S:.0f} s "
        f"({results[0]['steady_calls'] / jobs / (STEADY_S / 60):.1f} per job per minute; every job passes "
        f"at least once in any resync period): "
        + ", ".join(f"{k}: {v}" for k, v in sorted(results[0]["steady_by"].items()))
    )
    print(
        f"operator idle RSS: {idle_before:.0f} MiB after start-up, {idle_after:.0f} MiB after the load "
        f"(ratio to the Deployment's {REQUEST_MIB:.0f} MiB request: {idle_after / REQUEST_MIB:.2f})"
    )


def _calls(series: dict[str, float]) -> float:
    """The operator's API requests so far (its reconciles', not its watches')."""
    return sum(v for k, v in series.items() if k.startswith("lockstep_operator_api_requests_total{"))


def _passes(series: dict[str, float]) -> float:
    return sum(v for k, v in series.items() if k.startswith("lockstep_operator_reconciles_total{"))


def print_burst_details(r: dict[str, Any], jobs: int, want: int) -> None:
    """The first burst's supporting objects, CPU, passes, requests and waits."""
    support_s, during = r["support_s"], r["during"]
    print(
        f"  first burst: apply -> every job's {want} ConfigMaps, Secret, Services, RBAC and NetworkPolicies "
        f"exist: {support_s:.2f} s (created after the pods)"
    )
    print(
        f"  CPU seconds during the {jobs}-job burst (apply -> every object, {support_s:.1f} s wall): "
        + ", ".join(f"{k} {v:.1f}" for k, v in r["cpu"].items())
    )
    burst_passes = _passes(during)
    print(
        f"  reconcile rate during the burst: {burst_passes / support_s:.0f} passes/s ({burst_passes:.0f} passes)"
    )
    requests = {
        k.split("{", 1)[1].rstrip("}"): int(v)
        for k, v in during.items()
        if k.startswith("lockstep_operator_api_requests_total{") and v
    }
    print("  API requests during the burst: " + ", ".join(f"{k}: {v}" for k, v in sorted(requests.items())))
    waits = []
    for cls in ("urgent", "other"):
        total = during.get(f'lockstep_operator_api_request_wait_seconds_sum{{priority="{cls}"}}', 0.0)
        count = during.get(f'lockstep_operator_api_request_wait_seconds_count{{priority="{cls}"}}', 0.0)
        waits.append(f"{cls} {1000 * total / count:.0f} ms" if count else f"{cls} none")
    limited = during.get("lockstep_operator_rate_limited_seconds_total", 0.0)
    print(
        f"  mean wait for the client's gate during the burst: {', '.join(waits)}; "
        f"passes waited {limited:.1f} s in all for the token bucket"
    )


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` and of its descendants onto `cpus` (threads started later inherit it)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)
    for child in children.read_text().split() if children.exists() else []:
        pin(int(child), cpus)


def split_cores(cp: ControlPlane, op_pid: int) -> None:
    """The control plane on CPU 0; the operator and this process (its client, the baseline) on CPU 1."""
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("--split-cores needs two CPUs")
    for pid in cp.pids.values():
        pin(pid, {0})
    pin(op_pid, {1})
    for task in Path("/proc/self/task").iterdir():
        os.sched_setaffinity(int(task.name), {1})


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, help="repetitions of the one-job case (default 5)")
    parser.add_argument("--jobs", type=int, default=50, help="jobs applied at once (default 50)")
    parser.add_argument(
        "--bursts",
        type=int,
        default=3,
        help="repetitions of the many-job burst, each followed by its direct baseline (default 3): "
        "single runs on shared cores vary by 2x, the median of the ratios is the figure",
    )
    parser.add_argument(
        "--profile", metavar="PATH", help="run the operator under cProfile, its stats written to PATH"
    )
    parser.add_argument(
        "--split-cores",
        action="store_true",
        help="control plane on CPU 0, operator and the baseline's client on CPU 1 (as in a cluster)",
    )
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
        command = ["-c", PROFILED.format(path=str(Path(args.profile).resolve()))] if args.profile else []
        op = subprocess.Popen(
            [sys.executable, *(command or ["-m", "lockstep_operator"])],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        if args.split_cores:
            split_cores(cp, op.pid)
            print("split cores: control plane on CPU 0, operator and the bench's client on CPU 1")
        try:
            asyncio.run(scenarios(cp, op.pid, args.runs, args.jobs, args.bursts))
        finally:
            op.terminate()
            op.wait(timeout=30)
            log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
