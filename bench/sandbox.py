"""Sandbox figures: claim latency (warm pool and cold), sandboxes per second and exec round trip on the
local real node, next to agent-sandbox's own SLO; the local sandbox's exec round trip; episodes per
minute of the example's episode shape on one machine.

Why it exists: every episode of an agentic job claims a sandbox and runs a few commands in it, so the
claim and the exec are on the rollout's critical path. agent-sandbox's CI SLO for claim adoption is
p50 <= 300 ms and p99 <= 500 ms (on kwok); here the pods are real (kubelet, containerd, runc) on a
loaded 2-core machine.

Baselines measured in the same run (the ratio printed next to each figure):
- a warm claim vs starting a bare pod of the same image and waiting for it to run (what an episode
  would pay without a warm pool);
- a cold claim vs the same bare pod;
- a warm claim watched (the provider's path) vs the same warm claim polled with a GET every 50 ms
  (the provider before it watched; ClusterSandboxProvider.watch = False), same pool size;
- the local sandbox's exec (Landlock, rlimits, its helper process) vs an unconfined subprocess of the
  driver's process;
- cluster exec vs local exec.

Run: .venv/bin/python bench/sandbox.py [--local-only] [--claims 20] [--execs 50] [--episodes 64]
     [--checkpoint DIR] [--json bench/results/sandbox_<date>_cpu.json]
     [--rounds 2 "--controller-flags=--disable-claim-events ..."]  (agent-sandbox controller flag sets,
     each compared with its defaults on fresh warm pools in turns; the `=` keeps argparse from reading
     the flags as its own)
The cluster part starts the control plane with a real node and agent-sandbox (needs root; see
docs/controlplane.md) and stops it at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SLO_P50_S, SLO_P99_S = 0.300, 0.500


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def summary(xs: list[float]) -> dict[str, float]:
    return {"n": float(len(xs)), "p50_s": pct(xs, 50), "p99_s": pct(xs, 99), "mean_s": statistics.fmean(xs)}


# -------------------------------------------------------------------------------------------- local


async def local_figures(execs: int) -> dict[str, Any]:
    from lockstep.sandbox import LocalSandboxProvider, SandboxConfig

    provider = LocalSandboxProvider(SandboxConfig(image="unused", command_timeout_s=10))
    confined, plain, claims = [], [], []
    try:
        for i in range(execs):
            t0 = time.perf_counter()
            async with provider.claim(f"c{i}") as box:
                claims.append(time.perf_counter() - t0)
                t1 = time.perf_counter()
                await box.exec("true")
                confined.append(time.perf_counter() - t1)
            t2 = time.perf_counter()
            proc = await asyncio.create_subprocess_exec("/bin/sh", "-c", "true")
            await proc.wait()
            plain.append(time.perf_counter() - t2)
    finally:
        await provider.aclose()
    return {
        "local_exec": summary(confined),
        "unconfined_exec": summary(plain),
        "local_claim_release": summary(claims),
    }


async def episodes_per_minute(n: int, checkpoint: str) -> dict[str, float]:
    """n episodes of the example's shape (one `sh` turn of up to 64 tokens, setup, test) at once through
    the reference engine, the in-process session server and local sandboxes; twice, the second timed."""
    from lockstep.driver.engines import start_reference_engine
    from lockstep.models import load_tokenizer, resolve_checkpoint
    from lockstep.rollout.plugins import AgentContext
    from lockstep.rollout.terminal import episode_metrics, terminal_agent
    from lockstep.sandbox import LocalSandboxProvider, SandboxConfig
    from lockstep.serving import EngineClient, SamplingParams
    from lockstep.tasks import load_task
    from lockstep.types import Sample

    model = resolve_checkpoint(checkpoint) if checkpoint.startswith("builtin:") else Path(checkpoint)
    server = start_reference_engine(model, device="cpu")
    tok, task = load_tokenizer(model, None, None), load_task("builtin:shell")
    provider = LocalSandboxProvider(SandboxConfig(image="unused", command_timeout_s=10, output_limit=512))
    try:
        async with EngineClient(server.url) as client:
            ctx = AgentContext(
                client=client, sampling=SamplingParams(max_new_tokens=64, temperature=1.0,
                                                       stop_token_ids=list(tok.stop_token_ids)),
                decode=lambda ids: tok.decode(ids, skip_special_tokens=True), encode=tok.encode,
                max_turns=1, timeout_s=60, sandboxes=provider,
                extra={"family": "tiny", "tokenizer_dir": str(model)},
            )  # fmt: skip
            secs = 0.0
            for _ in range(2):
                samples = []
                for i in range(n):
                    item = task.item(i)
                    samples.append(Sample(0, i, [], metadata={**item.metadata, "item": item}))
                t0 = time.perf_counter()
                done = await asyncio.gather(*(terminal_agent(ctx, s) for s in samples))
                secs = time.perf_counter() - t0
            m = episode_metrics(done)
    finally:
        await provider.aclose()
        server.stop()
    return {"episodes": float(n), "seconds": secs, "episodes_per_minute": 60 * n / secs,
            "tests_passed_frac": m["sandbox_tests_passed_frac"]}  # fmt: skip


# ------------------------------------------------------------------------------------------ cluster


def cluster_figures(claims: int, execs: int, flag_sets: list[tuple[str, ...]], rounds: int) -> dict[str, Any]:
    from kubernetes import client, config
    from lockstep.api.rljob import RLJob
    from lockstep.sandbox import SandboxConfig
    from lockstep.sandbox.cluster import SANDBOX_OF_LABEL, ClusterSandboxProvider
    from lockstep_operator.resources.common import Owner
    from lockstep_operator.resources.sandbox import sandbox_manifests

    from e2e.controlplane.cluster import ControlPlane, find_binaries
    from e2e.controlplane.realnode import REAL_NODE_LABEL

    cp = ControlPlane(bin_dir=find_binaries(), nodes_file=None, real_node=True, sandboxes=True)
    cp.start()
    try:
        assert cp.node is not None
        busybox, ns = cp.node.images["busybox"], "bench"
        cp.kubectl("create", "namespace", ns)
        place = {"nodeSelector": {REAL_NODE_LABEL: "real"},
                 "tolerations": [{"key": REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}]}  # fmt: skip
        conf = client.Configuration()
        config.load_kube_config(str(cp.kubeconfig), client_configuration=conf)  # type: ignore[no-untyped-call]

        def pool(job: str, warm: int) -> ClusterSandboxProvider:
            spec = RLJob.model_validate({
                "apiVersion": "rl.lockstep.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": job},
                "spec": {"model": {"checkpoint": "builtin:tiny", "family": "tiny"},
                         "data": {"prompts": "builtin:shell"}, "placement": place,
                         "agent": {"sandbox": {"image": busybox, "warmPool": warm,
                                               "resources": {"cpu": "10m", "memory": "16Mi", "ephemeralStorage": "16Mi"}}}},
            }).spec  # fmt: skip
            cp.kubectl("create", "configmap", job, "-n", ns)  # the owner, named as the job (as an RLJob is)
            uid = cp.get("configmap", job, "-n", ns)["metadata"]["uid"]
            owner = Owner(api_version="v1", kind="ConfigMap", name=job, uid=uid, namespace=ns, labels={})
            cp.kubectl("apply", "--server-side", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                       "items": sandbox_manifests(owner, spec)[:2]}))  # fmt: skip
            if warm:
                cp.wait_for(lambda: sum(p["status"].get("phase") == "Running" for p in cp.get(
                    "pods", "-n", ns, "-l", f"{SANDBOX_OF_LABEL}={job}")["items"]) >= warm or None,
                    timeout=600, what=f"{warm} warm sandboxes")  # fmt: skip
            return ClusterSandboxProvider(config=SandboxConfig(image=busybox, command_timeout_s=10), namespace=ns,
                                          warm_pool=f"{job}-sandbox", job=job, max_sandboxes=claims,
                                          api=client.ApiClient(conf), claim_timeout_s=600)  # fmt: skip

        async def claim_all(
            provider: ClusterSandboxProvider, n: int, exec_n: int
        ) -> tuple[list[float], list[float], float]:
            rtts: list[float] = []

            async def one(i: int) -> None:
                async with provider.claim(f"b{i}") as box:
                    for _ in range(exec_n):
                        t0 = time.perf_counter()
                        await box.exec("true")
                        rtts.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(n)))
            wall = time.perf_counter() - t0
            await provider.aclose()
            return list(provider.claim_seconds), rtts, wall

        def gone(job: str) -> None:
            """Delete a pool's owner and wait until its sandbox pods are gone (garbage collection)."""
            cp.kubectl("delete", "configmap", job, "-n", ns)
            cp.wait_for(lambda: not cp.get("pods", "-n", ns, "-l", f"{SANDBOX_OF_LABEL}={job}")["items"] or None,
                        timeout=600, what=f"the pods of pool {job} gone")  # fmt: skip

        def bare_pod_start(i: int) -> float:
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"bare-{i}", "namespace": ns},
                   "spec": {**place, "terminationGracePeriodSeconds": 0, "containers": [{"name": "c", "image": busybox,
                            "imagePullPolicy": "Never", "command": ["sleep", "3600"]}]}}  # fmt: skip
            t0 = time.perf_counter()
            cp.kubectl("apply", "-f", "-", input=json.dumps(pod))
            cp.wait_for(lambda: cp.get("pod", f"bare-{i}", "-n", ns)["status"].get("phase") == "Running" or None,
                        timeout=300, what="a bare pod running")  # fmt: skip
            secs = time.perf_counter() - t0
            cp.kubectl("delete", "pod", f"bare-{i}", "-n", ns, "--wait=false")
            return secs

        bare = [bare_pod_start(i) for i in range(3)]
        warm_claims, rtts, warm_wall = asyncio.run(
            claim_all(pool("warm", claims), claims, execs // claims or 1)
        )
        polled = pool("polled", claims)
        polled.watch = False
        polled_claims, _, polled_wall = asyncio.run(claim_all(polled, claims, 0))
        cold_claims, _, _cold_wall = asyncio.run(claim_all(pool("cold", 0), 3, 1))
        # Warm claims (no execs) with agent-sandbox's default flags and with each flag set, in turns
        # (docs/sandbox.md, "The agent-sandbox controller"): the same pool size, `rounds` times each
        by_flags: dict[str, list[float]] = {}
        for r in range(rounds if flag_sets else 0):  # nothing to compare: no extra turns
            for k, flags in enumerate([(), *flag_sets]):
                cp.restart_sandbox_controller(flags)
                took, _, _ = asyncio.run(claim_all(pool(f"f{k}r{r}", claims), claims, 0))
                by_flags.setdefault(" ".join(flags) or "(default)", []).extend(took)
                gone(f"f{k}r{r}")  # the node's pod limit; and no deletions under the next turn
    finally:
        cp.stop()
    return {
        "bare_pod_start": summary(bare),
        "warm_claim": summary(warm_claims),
        "warm_claims_per_second": claims / warm_wall,
        "warm_claim_polled": summary(polled_claims),
        "warm_claims_per_second_polled": claims / polled_wall,
        "cold_claim": summary(cold_claims),
        "warm_claim_by_controller_flags": {f: summary(took) for f, took in by_flags.items()},
        "cluster_exec": summary(rtts),
        "slo": {"claim_p50_s": SLO_P50_S, "claim_p99_s": SLO_P99_S},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local-only", action="store_true")
    p.add_argument("--claims", type=int, default=10, help="concurrent warm claims (the warm pool's size)")
    p.add_argument("--execs", type=int, default=50, help="exec round trips measured (local and cluster)")
    p.add_argument("--episodes", type=int, default=64, help="episodes at once for episodes per minute")
    p.add_argument("--checkpoint", default="builtin:tiny-deep")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--controller-flags",
        action="append",
        default=[],
        metavar="FLAGS",
        help="agent-sandbox controller flags (space-separated) to compare with its defaults; repeatable",
    )
    p.add_argument("--rounds", type=int, default=1, help="turns of the controller-flags comparison")
    args = p.parse_args()
    out: dict[str, Any] = {"local": asyncio.run(local_figures(args.execs))}
    out["one_machine"] = asyncio.run(episodes_per_minute(args.episodes, args.checkpoint))
    if not args.local_only:
        flag_sets = [tuple(f.split()) for f in args.controller_flags]
        out["cluster"] = cluster_figures(args.claims, args.execs, flag_sets, args.rounds)
    loc = out["local"]
    print(f"local exec p50 {loc['local_exec']['p50_s'] * 1e3:.1f} ms p99 {loc['local_exec']['p99_s'] * 1e3:.1f} ms "
          f"({loc['local_exec']['p50_s'] / loc['unconfined_exec']['p50_s']:.2f}x an unconfined subprocess)")  # fmt: skip
    om = out["one_machine"]
    print(
        f"one machine: {om['episodes_per_minute']:.0f} episodes/min ({om['episodes']:.0f} at once, {om['seconds']:.1f} s)"
    )
    if "cluster" in out:
        c = out["cluster"]
        for name in ("warm_claim", "warm_claim_polled", "cold_claim", "cluster_exec"):
            s = c[name]
            print(f"{name}: p50 {s['p50_s'] * 1e3:.0f} ms p99 {s['p99_s'] * 1e3:.0f} ms "
                  f"(p50 {s['p50_s'] / c['bare_pod_start']['p50_s']:.2f}x a bare pod start)")  # fmt: skip
        print(f"warm claims/s {c['warm_claims_per_second']:.2f}; SLO p50 <= {SLO_P50_S * 1e3:.0f} ms, p99 <= "
              f"{SLO_P99_S * 1e3:.0f} ms: warm p50 {c['warm_claim']['p50_s'] / SLO_P50_S:.2f}x, p99 "
              f"{c['warm_claim']['p99_s'] / SLO_P99_S:.2f}x the SLO; cluster exec p50 "
              f"{c['cluster_exec']['p50_s'] / loc['local_exec']['p50_s']:.1f}x the local exec")  # fmt: skip
        runs = c["warm_claim_by_controller_flags"]
        for flags, b in runs.items():
            d = runs["(default)"]
            print(f"warm claim (no execs), controller {flags}: p50 {b['p50_s'] * 1e3:.0f} ms p99 "
                  f"{b['p99_s'] * 1e3:.0f} ms ({b['p50_s'] / d['p50_s']:.2f}x / {b['p99_s'] / d['p99_s']:.2f}x "
                  f"the default flags; SLO {b['p50_s'] / SLO_P50_S:.2f}x / {b['p99_s'] / SLO_P99_S:.2f}x)")  # fmt: skip
        w, q = c["warm_claim"], c["warm_claim_polled"]
        print(f"warm claim watched vs polled every 50 ms: p50 {w['p50_s'] / q['p50_s']:.2f}x, p99 "
              f"{w['p99_s'] / q['p99_s']:.2f}x")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
