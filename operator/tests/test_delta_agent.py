"""disk-delta per host: an explicit disk-delta job with a shared volume renders each engine pod with its
agent sidecar and a node-local volume for its copy (resources.delta_agent); other jobs render none."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from lockstep.api import RLJob, load_manifest
from lockstep.api.rolloutpool import RolloutPoolSpec
from lockstep_operator.resources.annotations import Annotation
from lockstep_operator.resources.children import child_manifests
from lockstep_operator.resources.common import Owner
from lockstep_operator.resources.engines import engine_manifest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cluster.yaml"


def _job(transport: str, path: str | None = None) -> RLJob:
    doc = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    doc["spec"]["weightSync"]["transport"] = transport
    if path is not None:
        doc["spec"]["weightSync"]["diskDelta"]["path"] = path
    return load_manifest(yaml.safe_dump(doc))


def _engine_pod(job: RLJob) -> dict[str, Any]:
    owner = Owner("rl.lockstep.dev/v1alpha1", "RLJob", job.metadata.name, "u", "ns")
    pool = next(
        c for c in child_manifests(owner, job.spec, suspended=False, stopped="") if c["kind"] == "RolloutPool"
    )
    ann = pool["metadata"]["annotations"]
    spec = RolloutPoolSpec.model_validate(pool["spec"])
    pool_owner = Owner("rl.lockstep.dev/v1alpha1", "RolloutPool", pool["metadata"]["name"], "u2", "ns")
    return engine_manifest(pool_owner, spec, 0, gang_min=0, image="runtime:1",
                           shared_volume=ann[Annotation.SHARED_VOLUME.value],
                           delta_agent=ann.get(Annotation.DELTA_AGENT.value), runtime_image="runtime:1")  # fmt: skip


def test_an_explicit_disk_delta_job_runs_an_agent_beside_every_engine() -> None:
    job = _job("disk-delta")
    pod = _engine_pod(job)
    main, agent = pod["spec"]["containers"]
    assert agent["name"] == "delta-agent" and agent["image"] == "runtime:1"
    scope = job.metadata.name
    assert agent["command"][:3] == ["lockstep", "delta", "agent"]
    args = dict(zip(agent["command"][3::2], agent["command"][4::2], strict=True))
    # where rank 0 publishes: its run dir (`lockstep trainer --out`'s default) under the ranks' run dir
    assert args["--root"] == f"/shared/lockstep/{scope}/trainer/delta"
    assert args["--local"] == "/var/lib/lockstep/delta-local/$(POD_NAME)"  # this pod's own copy
    # the engine beside it, on the pod IP it listens on (`--host $(POD_IP)`), not on loopback
    assert main["command"][main["command"].index("--host") + 1] == "$(POD_IP)"
    assert "--engine" not in args and args["--port"] == "30001"  # the agent's default: the engine on --host
    assert {"name": "delta-local", "emptyDir": {}} in pod["spec"]["volumes"]
    # the reference engine may read disk updates from the copy's volume, read-only
    i = main["command"].index("--weights-root", main["command"].index("--weights-root") + 1)
    assert main["command"][i + 1] == "/var/lib/lockstep/delta-local"
    assert {"name": "delta-local", "mountPath": "/var/lib/lockstep/delta-local", "readOnly": True} in main[
        "volumeMounts"
    ]
    assert agent["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    key = next(e for e in agent["env"] if e["name"] == "LOCKSTEP_API_KEY")
    assert key["valueFrom"]["secretKeyRef"]["name"] == f"{scope}-api-key"


def test_a_node_path_is_a_host_path() -> None:
    pod = _engine_pod(_job("disk-delta", "/mnt/nvme/lockstep"))
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "delta-local")
    assert volume == {
        "name": "delta-local",
        "hostPath": {"path": "/mnt/nvme/lockstep", "type": "DirectoryOrCreate"},
    }


@pytest.mark.parametrize("transport", ["auto", "broadcast"])
def test_other_transports_render_no_agent(transport: str) -> None:
    pod = _engine_pod(_job(transport))
    assert [c["name"] for c in pod["spec"]["containers"]] == ["main"]
