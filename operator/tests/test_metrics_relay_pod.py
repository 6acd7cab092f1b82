"""SGLang engine pods get the metrics relay sidecar serving the `metrics` port (resources.metrics_relay);
reference engine pods serve that port themselves and get none."""

from __future__ import annotations

from pathlib import Path

import pytest
from lockstep.api import load_manifest
from lockstep.api.rolloutpool import RolloutPoolSpec
from lockstep_operator.resources.children import child_manifests
from lockstep_operator.resources.common import Owner
from lockstep_operator.resources.engines import engine_manifest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _engine_pod(example: str) -> dict:  # type: ignore[type-arg]
    job = load_manifest(EXAMPLES / f"{example}.yaml")
    own = Owner("rl.lockstep.dev/v1alpha1", "RLJob", job.metadata.name, "uid-1", "ns")
    pool, _, _ = child_manifests(own, job.spec, suspended=False, stopped="")
    spec = RolloutPoolSpec.model_validate(pool["spec"])
    pool_owner = Owner("rl.lockstep.dev/v1alpha1", "RolloutPool", "p", "uid-2", "ns")
    return engine_manifest(pool_owner, spec, 0, gang_min=1, image="sglang:1", runtime_image="runtime:1")


def test_an_sglang_engine_pod_relays_its_metrics_on_the_metrics_port() -> None:
    pod = _engine_pod("h100")
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    relay = containers["metrics-relay"]
    assert relay["image"] == "runtime:1"
    assert relay["command"] == ["lockstep", "metrics-relay", "--source", "http://$(POD_IP):30000/metrics",
                                "--host", "$(POD_IP)", "--port", "9400"]  # fmt: skip
    assert relay["ports"] == [{"name": "metrics", "containerPort": 9400}]
    # one `metrics` port in the pod (names are unique per pod): the relay's, not SGLang's
    assert [p["name"] for p in containers["main"]["ports"]] == ["http"]
    # PSS restricted: the pod's runAsNonRoot and seccomp, no escalation, every capability dropped
    assert relay["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["spec"]["automountServiceAccountToken"] is False
    # no secret: SGLang lets /metrics through without the API key
    assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in relay["env"])
    assert relay["resources"]["requests"] == {"cpu": "10m", "memory": "64Mi"}


@pytest.mark.parametrize("example", ["tiny-local"])
def test_a_reference_engine_pod_serves_the_metrics_port_itself(example: str) -> None:
    pod = _engine_pod(example)
    assert [c["name"] for c in pod["spec"]["containers"]] == ["main"]
    assert {"name": "metrics", "containerPort": 9400} in pod["spec"]["containers"][0]["ports"]
