"""Per-episode sandboxes on the real node: the operator's SandboxTemplate and SandboxWarmPool, served
by kubernetes-sigs/agent-sandbox's controller (built from its pinned module), claimed and used by the
driver's provider (lockstep.sandbox.cluster) through the Kubernetes API. Commands run in real pods;
a pod killed mid-episode aborts only that episode; claims never outlive their driver; deleting the
owner leaves no Sandbox, claim or pod. (docs/sandbox.md, "In a cluster".)

The job's objects are owned by a ConfigMap standing in for the RLJob (the garbage collector only needs
an owner that exists), and the driver by a plain pod: the RLJob itself runs in e2e/test_realpods.py's
style where the runtime image is built.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from lockstep.api.rljob import RLJob
from lockstep.sandbox import SandboxConfig, SandboxError
from lockstep.sandbox.cluster import SANDBOX_OF_LABEL, ClusterSandboxProvider
from lockstep_operator.resources.common import Owner
from lockstep_operator.resources.sandbox import sandbox_manifests, sandbox_name

from e2e.controlplane.cluster import ControlPlane
from e2e.controlplane.realnode import REAL_NODE_LABEL

pytestmark = pytest.mark.e2e
JOB = "box"


@pytest.fixture(scope="session")
def sandbox_cluster(real_cluster: ControlPlane) -> ControlPlane:
    """The real-node cluster with agent-sandbox's CRDs and controller."""
    if "agent-sandbox-controller" not in real_cluster.pids:
        real_cluster.start_sandboxes()
    return real_cluster


def _job(busybox: str, warm: int) -> RLJob:
    return RLJob.model_validate(
        {
            "apiVersion": "rl.lockstep.dev/v1alpha1",
            "kind": "RLJob",
            "metadata": {"name": JOB},
            "spec": {
                "model": {"checkpoint": "builtin:tiny", "family": "tiny"},
                "data": {"prompts": "builtin:shell"},
                "algorithm": {"samplesPerPrompt": 2, "batchSize": 1},
                "agent": {
                    "sandbox": {
                        "image": busybox,
                        "commandTimeoutSeconds": 5,
                        "resources": {"cpu": "50m", "memory": "32Mi", "ephemeralStorage": "8Mi"},
                        "warmPool": warm,
                    }
                },
                "placement": {
                    "nodeSelector": {REAL_NODE_LABEL: "real"},
                    "tolerations": [{"key": REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
                },
            },
        }
    )


class _Job:
    """The job's sandbox objects in `ns`, owned by a ConfigMap standing in for the RLJob."""

    def __init__(self, cluster: ControlPlane, ns: str, warm: int) -> None:
        self.cluster, self.ns = cluster, ns
        assert cluster.node is not None
        cluster.kubectl("create", "configmap", JOB, "-n", ns)
        uid = cluster.get("configmap", JOB, "-n", ns)["metadata"]["uid"]
        owner = Owner(api_version="v1", kind="ConfigMap", name=JOB, uid=uid, namespace=ns, labels={})
        manifests = sandbox_manifests(owner, _job(cluster.node.images["busybox"], warm).spec)
        cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(manifests[:2]))

    def driver_pod(self, name: str) -> tuple[str, str]:
        """A pod standing in for the driver: (name, uid), the owner of its claims."""
        assert self.cluster.node is not None
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": self.ns},
            "spec": {
                "containers": [
                    {
                        "name": "c",
                        "image": self.cluster.node.images["busybox"],
                        "command": ["sleep", "3600"],
                        "imagePullPolicy": "Never",
                    }
                ],
                "nodeSelector": {REAL_NODE_LABEL: "real"},
                "tolerations": [{"key": REAL_NODE_LABEL, "operator": "Exists"}],
                "terminationGracePeriodSeconds": 0,
            },
        }
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
        return name, self.cluster.get("pod", name, "-n", self.ns)["metadata"]["uid"]

    def provider(self, owner_pod: tuple[str, str] | None = None, **kw: Any) -> ClusterSandboxProvider:
        from kubernetes import client, config

        conf = client.Configuration()
        config.load_kube_config(str(self.cluster.kubeconfig), client_configuration=conf)  # type: ignore[no-untyped-call]
        return ClusterSandboxProvider(
            config=SandboxConfig(image="busybox", command_timeout_s=5, output_limit=256),
            namespace=self.ns, warm_pool=sandbox_name(JOB), job=JOB, owner_pod=owner_pod,
            api=client.ApiClient(conf), **kw,
        )  # fmt: skip

    def names(self, kind: str, selector: str = "") -> list[str]:
        args = ["-n", self.ns, *(["-l", selector] if selector else [])]
        return sorted(i["metadata"]["name"] for i in self.cluster.get(kind, *args)["items"])

    def sandbox_pods(self) -> list[str]:
        return self.names("pods", f"{SANDBOX_OF_LABEL}={JOB}")

    def wait(self, probe: Any, what: str, timeout: float = 180) -> Any:
        return self.cluster.wait_for(probe, timeout=timeout, what=what)


@pytest.fixture
def job(sandbox_cluster: ControlPlane, real_namespace: str) -> Iterator[_Job]:
    yield _Job(sandbox_cluster, real_namespace, warm=2)


def test_episodes_run_commands_in_claimed_pods_which_go_away_after(job: _Job) -> None:
    job.wait(lambda: len(job.sandbox_pods()) == 2 or None, "the warm pool's 2 pods")

    async def episode() -> list[Any]:
        provider = job.provider()
        try:
            async with provider.claim("g0-s0") as box:
                out = [await box.exec("echo hi > f && cat f && id -u && pwd")]
                out.append(await box.exec("echo x > /etc/x"))  # only the working directory is writable
                out.append(
                    await box.exec("wget -q -T 3 -O - http://kubernetes.default.svc:443 || echo refused")
                )
                out.append(await box.exec("sleep 30", timeout_s=1))
                out.append(job.names("sandboxclaims"))
            return out
        finally:
            await provider.aclose()

    hi, outside, egress, slow, claims = asyncio.run(episode())
    assert (hi.exit_code, hi.output) == (0, "hi\n65534\n/workspace\n")
    assert outside.exit_code != 0
    assert egress.output.strip().endswith("refused"), egress.output  # egress denied by the template's policy
    assert slow.timed_out and slow.exit_code == 124
    assert len(claims) == 1
    job.wait(lambda: not job.names("sandboxclaims") or None, "the claim deleted at release")
    job.wait(lambda: len(job.sandbox_pods()) == 2 or None, "the pool back at 2 pods (replenished)")


def test_a_sandbox_pod_killed_mid_episode_aborts_that_episode_only(job: _Job) -> None:
    job.wait(lambda: len(job.sandbox_pods()) == 2 or None, "the warm pool's 2 pods")

    async def episodes() -> tuple[BaseException | None, str]:
        provider = job.provider()
        try:
            async with provider.claim("g0-s0") as box:
                running = asyncio.create_task(box.exec("sleep 90", timeout_s=120))
                await asyncio.sleep(2)
                # as an eviction or a failing node would: the kubelet kills the container under the command
                job.cluster.kubectl(
                    "delete", "pod", box.pod, "-n", job.ns, "--grace-period=0", "--wait=false"
                )
                try:
                    await running
                    lost: BaseException | None = None
                except SandboxError as e:
                    lost = e
            async with provider.claim("g0-s1") as other:  # the job goes on with another sandbox
                return lost, (await other.exec("echo fine")).output
        finally:
            await provider.aclose()

    lost, fine = asyncio.run(episodes())
    assert isinstance(lost, SandboxError) and lost.reason == "SandboxLost"
    assert fine == "fine\n"


_CRASHING_DRIVER = """
import asyncio, os, sys
from kubernetes import client, config
from lockstep.sandbox import SandboxConfig
from lockstep.sandbox.cluster import ClusterSandboxProvider
kubeconfig, ns, pool, job, key, pod, uid = sys.argv[1:]
conf = client.Configuration()
config.load_kube_config(kubeconfig, client_configuration=conf)
async def main():
    provider = ClusterSandboxProvider(config=SandboxConfig(image="busybox"), namespace=ns, warm_pool=pool,
                                      job=job, owner_pod=(pod, uid), api=client.ApiClient(conf))
    await provider.claim(key).__aenter__()
    os._exit(0)  # the driver dies holding its claim: no clean-up runs
asyncio.run(main())
"""


def _crash_holding_a_claim(job: _Job, owner: tuple[str, str], key: str) -> None:
    import subprocess
    import sys

    args = [str(job.cluster.kubeconfig), job.ns, sandbox_name(JOB), JOB, key, *owner]
    subprocess.run([sys.executable, "-c", _CRASHING_DRIVER, *args], check=True, timeout=300)


def test_a_restarted_driver_leaks_no_claim(job: _Job) -> None:
    job.wait(lambda: len(job.sandbox_pods()) == 2 or None, "the warm pool's 2 pods")
    first = job.driver_pod("driver-1")
    _crash_holding_a_claim(job, first, "g0-s0")
    assert len(job.names("sandboxclaims")) == 1
    # The driver starts again in the same pod: its first claim deletes what the job left.
    _crash_holding_a_claim(job, first, "g1-s0")
    (left,) = job.names("sandboxclaims")
    assert "g1-s0" in left
    # The driver pod is replaced: its claims go with it (owner references), whatever the process did.
    job.cluster.kubectl("delete", "pod", first[0], "-n", job.ns, "--grace-period=0", "--force")
    job.wait(lambda: not job.names("sandboxclaims") or None, "the claims of the deleted driver pod")
    job.wait(lambda: len(job.sandbox_pods()) == 2 or None, "only the warm pool's pods left")


def test_deleting_the_job_leaves_no_sandbox_claim_or_pod(job: _Job) -> None:
    job.wait(lambda: len(job.sandbox_pods()) == 2 or None, "the warm pool's 2 pods")
    driver = job.driver_pod("driver-2")
    _crash_holding_a_claim(job, driver, "g0-s0")
    assert len(job.names("sandboxclaims")) == 1
    job.cluster.kubectl("delete", "configmap", JOB, "-n", job.ns)  # the RLJob's stand-in
    job.cluster.kubectl(
        "delete", "pod", driver[0], "-n", job.ns, "--grace-period=0"
    )  # its driver (owned too)
    t0 = time.monotonic()
    for kind in ("sandboxtemplates", "sandboxwarmpools", "sandboxclaims", "sandboxes"):
        job.wait(lambda kind=kind: not job.names(kind) or None, f"no {kind} left")
    job.wait(lambda: not job.sandbox_pods() or None, "no sandbox pod left")
    assert time.monotonic() - t0 < 180


def test_claims_held_at_once_never_exceed_max_sandboxes(job: _Job) -> None:
    job.wait(lambda: len(job.sandbox_pods()) == 2 or None, "the warm pool's 2 pods")
    seen: list[int] = []

    async def episodes() -> None:
        provider = job.provider(max_sandboxes=2)

        async def one(i: int) -> None:
            async with provider.claim(f"g0-s{i}") as box:
                seen.append(len(provider.live))
                await box.exec("sleep 1")

        try:
            await asyncio.gather(*(one(i) for i in range(5)))
        finally:
            await provider.aclose()

    asyncio.run(episodes())
    assert len(seen) == 5 and max(seen) <= 2, seen
    job.wait(lambda: not job.names("sandboxclaims") or None, "every claim released")
