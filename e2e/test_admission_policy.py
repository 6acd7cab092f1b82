"""The shipped ValidatingAdmissionPolicy (charts/lockstep, admissionPolicy.enabled; the same object as
manifests/optional/admission-policy.yaml) refuses, on the real API server, an RLJob naming an image
outside the allowed registries, pinning a node by a label outside the allowed keys, or tolerating a
taint outside the allowed ones, with a message naming the field and the fix; an RLJob within them, or
naming no image, is admitted.

Why: whoever may create an RLJob may otherwise run any image on any node through the operator's
rights. The policy's CEL runs only in the API server, so only a real one can show it compiles,
matches RLJobs and says what it should. It is bound to this test's namespace alone (its
namespaceSelector value), so the other tests of the session are not subject to it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.controlplane.cluster import ControlPlane
from e2e.operator_runner import CHART, RELEASE, SYSTEM_NS
from e2e.test_operator_reconcile import WAIT, tiny

ROOT = Path(__file__).resolve().parent.parent
POLICY = "lockstep-operator-rljob-images-and-nodes"


@pytest.fixture
def policy(cluster: ControlPlane, namespace: str) -> Any:
    """The chart's policy (default allowed lists) bound to `namespace` only; removed after the test."""
    assert cluster.bin_dir is not None
    for crd in sorted((ROOT / "crds").glob("rl.lockstep.dev_*.yaml")):
        cluster.apply(crd.read_text())
    cluster.kubectl("wait", "--for=condition=Established", "crd/rljobs.rl.lockstep.dev", "--timeout=60s")
    cluster.kubectl("label", "namespace", namespace, f"lockstep-policy-test={namespace}")
    out = subprocess.run(
        [str(cluster.bin_dir / "helm"), "template", RELEASE, str(CHART), "-n", SYSTEM_NS,
         "--show-only=templates/admission-policy.yaml", "--set=admissionPolicy.enabled=true",
         f"--set=admissionPolicy.namespaceSelector.matchLabels.lockstep-policy-test={namespace}"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    docs = [d for d in yaml.safe_load_all(out) if d]
    cluster.apply(docs)
    yield docs
    for doc in docs:
        cluster.kubectl("delete", doc["kind"], doc["metadata"]["name"], "--wait=false", check=False)


def create(cluster: ControlPlane, ns: str, job: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """A server-side dry-run create: admission runs in full, nothing is stored."""
    return cluster.kubectl(
        "create", "--dry-run=server", "-n", ns, "-f", "-", input=yaml.safe_dump(job), check=False
    )


def test_the_policy_refuses_images_and_nodes_outside_the_allowed_ones(
    cluster: ControlPlane, namespace: str, policy: Any
) -> None:
    outside = tiny("outside", rollout={"image": "docker.io/someone/miner:1"})
    # The API server compiles and starts enforcing a new policy within a moment: wait for the first refusal.
    cluster.wait_for(
        lambda: create(cluster, namespace, outside).returncode != 0, timeout=WAIT, what="the policy enforced"
    )
    refused = create(cluster, namespace, outside)
    assert POLICY in refused.stderr, refused.stderr
    assert (
        "image docker.io/someone/miner:1 is outside the allowed registries (ghcr.io/lockstep/)"
        in refused.stderr
    )
    assert "admissionPolicy.allowedRegistries" in refused.stderr  # the fix

    for case, job, words in [
        ("trainer image", tiny("t", trainer={"image": "registry.example/lockstep-runtime:0.1.0"}),
         "image registry.example/lockstep-runtime:0.1.0 is outside"),
        ("a node by hostname", tiny("h", placement={"nodeSelector": {"kubernetes.io/hostname": "control-plane"}}),
         "spec.placement.nodeSelector key kubernetes.io/hostname is not allowed"),
        ("every taint tolerated", tiny("e", placement={"tolerations": [{"operator": "Exists"}]}),
         "spec.placement.tolerations may only tolerate taints nvidia.com/gpu"),
    ]:  # fmt: skip
        proc = create(cluster, namespace, job)
        assert proc.returncode != 0 and words in proc.stderr, (case, proc.stderr)

    allowed = [
        tiny("defaults"),  # no image named: the operator's release defaults
        tiny("ours", rollout={"image": "ghcr.io/lockstep/lockstep-engine:0.1.0"}),
        tiny(
            "placed",
            placement={
                "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            },
        ),
    ]
    for job in allowed:
        proc = create(cluster, namespace, job)
        assert proc.returncode == 0, (job["metadata"]["name"], proc.stderr)
