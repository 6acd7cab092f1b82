"""End-to-end: the scheduler never places an image on a node whose architecture the image lacks.

Why: GB300 trays are Grace (arm64). A rank pod whose image exists for amd64 only would be placed there
by GPU product alone and fail with `exec format error`. The operator renders a required node affinity
on kubernetes.io/arch from the images' architectures (operator settings, resources.platforms); here
the real kube-scheduler places rendered rank pods of the GB300 example on the kwok nodes of
e2e/nodes.yaml (GB300 arm64, H100 amd64).
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from lockstep.api import RLJob
from lockstep.api.images import image_ref
from lockstep.api.trainergroup import TrainerGroupSpec
from lockstep_operator.resources.children import child_manifests
from lockstep_operator.resources.common import Owner
from lockstep_operator.resources.ranks import rank_manifest
from lockstep_operator.settings import OperatorSettings

from e2e.controlplane.cluster import ControlPlane
from e2e.test_operator_reconcile import ROOT


def _rank_pod(name: str, image: str, namespace: str, settings: OperatorSettings) -> dict[str, Any]:
    job = RLJob.model_validate(yaml.safe_load((ROOT / "examples" / "glm5-gb300.yaml").read_text()))
    job.spec.placement.gang.scheduler = type(job.spec.placement.gang.scheduler)("none")
    owner = Owner(
        "rl.lockstep.dev/v1alpha1", "RLJob", name, "00000000-0000-0000-0000-000000000000", namespace
    )
    _, trainer, _ = child_manifests(owner, job.spec, suspended=False, stopped="")
    spec = TrainerGroupSpec.model_validate(trainer["spec"])
    pod = rank_manifest(
        owner, spec, 0, generation=0, gang_min=0, clique=None, image=image, facts=settings.node_facts()
    )
    pod["metadata"].pop("ownerReferences")  # no RLJob object here: the garbage collector would delete it
    pod["metadata"]["name"] = name
    pod["spec"].pop("serviceAccountName")  # the job's ServiceAccount is the RLJob reconcile's
    return pod


def _scheduled(cluster: ControlPlane, ns: str, name: str) -> dict[str, Any]:
    def placed() -> dict[str, Any] | None:
        pod: dict[str, Any] = cluster.get("pod", name, "-n", ns)
        conditions = {c["type"]: c for c in pod["status"].get("conditions", [])}
        return pod if "PodScheduled" in conditions else None

    return cluster.wait_for(placed, timeout=60, what=f"pod {ns}/{name} scheduled or refused")


def _node_arch(cluster: ControlPlane, node: str) -> str:
    return str(cluster.get("node", node)["metadata"]["labels"]["kubernetes.io/arch"])


@pytest.mark.e2e
def test_gb300_ranks_run_the_release_image_on_arm64_and_never_an_amd64_only_one(
    cluster: ControlPlane, namespace: str
) -> None:
    settings = OperatorSettings()
    # The release runtime image is a multi-architecture index: a GB300 (arm64) tray takes the rank.
    cluster.apply(_rank_pod("release", image_ref("runtime"), namespace, settings), namespace=namespace)
    pod = _scheduled(cluster, namespace, "release")
    assert pod["spec"]["nodeName"].startswith("gb300-"), pod["status"]
    assert _node_arch(cluster, pod["spec"]["nodeName"]) == "arm64"
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64", "arm64"]} in terms[
        "nodeSelectorTerms"
    ][0]["matchExpressions"]

    # An image no setting declares is amd64 only: GPU product GB300 plus arch amd64 matches no node,
    # so the scheduler leaves it Pending and says why, instead of an exec format error on a tray.
    cluster.apply(
        _rank_pod("amd64-only", "registry.example/trainer:1", namespace, settings), namespace=namespace
    )
    pod = _scheduled(cluster, namespace, "amd64-only")
    scheduled = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
    assert scheduled["status"] == "False" and scheduled["reason"] == "Unschedulable", scheduled
    assert "node affinity" in scheduled["message"], scheduled["message"]
    assert not pod["spec"].get("nodeName")

    # Declared multi-architecture in the settings (the cluster's registry has the arm64 variant), the
    # same image lands on a GB300 tray.
    declared = OperatorSettings(image_architectures=("registry.example/=amd64|arm64",))
    cluster.apply(
        _rank_pod("declared", "registry.example/trainer:1", namespace, declared), namespace=namespace
    )
    pod = _scheduled(cluster, namespace, "declared")
    assert _node_arch(cluster, pod["spec"]["nodeName"]) == "arm64", pod["status"]
