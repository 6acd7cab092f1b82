"""spec.trainer.localDisk: validated with errors naming the field and the fix, rendered as a volume of
every rank pod mounted where the trainer looks (resources.local_disk, lockstep.train.factory)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from lockstep.api import ManifestError, parse_object
from lockstep.api.trainergroup import TrainerGroupSpec
from lockstep_operator.resources.common import Owner
from lockstep_operator.resources.ranks import rank_manifest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-megatron.yaml"


def _job(local_disk: dict[str, Any] | None, **trainer: Any) -> dict[str, Any]:
    doc = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    doc["spec"]["trainer"].update(trainer)
    if local_disk is not None:
        doc["spec"]["trainer"]["localDisk"] = local_disk
    return doc


def _rank(local_disk: dict[str, Any]) -> dict[str, Any]:
    group = TrainerGroupSpec.model_validate(
        {
            "job": "j",
            "model": {"checkpoint": "/m", "family": "qwen3"},
            "trainer": {"offload": "disk", "localDisk": local_disk},
        }
    )
    owner = Owner("rl.lockstep.dev/v1alpha1", "TrainerGroup", "j-trainer", "u", "ns")
    return rank_manifest(owner, group, 0, generation=0, gang_min=0, clique=None, image="ghcr.io/lockstep/r:1")


def test_a_host_path_is_the_nodes_directory_mounted_at_the_same_path() -> None:
    pod = _rank({"path": "/mnt/nvme/lockstep", "source": "hostPath"})
    assert {
        "name": "local-disk",
        "hostPath": {"path": "/mnt/nvme/lockstep", "type": "DirectoryOrCreate"},
    } in pod["spec"]["volumes"]
    assert {"name": "local-disk", "mountPath": "/mnt/nvme/lockstep"} in pod["spec"]["containers"][0][
        "volumeMounts"
    ]


def test_an_ephemeral_disk_is_a_claim_created_with_each_rank_pod() -> None:
    pod = _rank({"path": "/scratch", "size": "500Gi", "storageClassName": "local-nvme"})
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "local-disk")
    assert volume["ephemeral"]["volumeClaimTemplate"]["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "500Gi"}},
        "storageClassName": "local-nvme",
    }
    assert {"name": "local-disk", "mountPath": "/scratch"} in pod["spec"]["containers"][0]["volumeMounts"]


def test_without_local_disk_no_volume_is_added() -> None:
    parse_object(_job(None))  # the example is valid as shipped
    group = TrainerGroupSpec.model_validate({"job": "j", "model": {"checkpoint": "/m", "family": "qwen3"}})
    owner = Owner("rl.lockstep.dev/v1alpha1", "TrainerGroup", "j-trainer", "u", "ns")
    pod = rank_manifest(owner, group, 0, generation=0, gang_min=0, clique=None, image="ghcr.io/lockstep/r:1")
    assert all(v["name"] != "local-disk" for v in pod["spec"]["volumes"])


@pytest.mark.parametrize(
    ("local_disk", "trainer", "field", "message"),
    [
        (
            {"path": "/mnt/nvme"},
            {"offload": "disk"},
            "spec.trainer.localDisk.size",
            "set trainer.localDisk.size",
        ),
        (
            {"path": "/mnt/nvme", "source": "hostPath", "size": "1Gi"},
            {"offload": "disk"},
            "spec.trainer.localDisk.source",
            "a hostPath is the node's directory as it is",
        ),
        (
            {"path": "/mnt/nvme", "size": "1Gi"},
            {},
            "spec.trainer.localDisk",
            "set one of them, or remove localDisk",
        ),
        (
            {"path": "/mnt/../etc", "size": "1Gi"},
            {"offload": "disk"},
            "spec.trainer.localDisk.path",
            "pattern",
        ),
        ({"path": "relative", "size": "1Gi"}, {"offload": "disk"}, "spec.trainer.localDisk.path", "pattern"),
        ({"path": "/x", "size": "lots"}, {"offload": "disk"}, "spec.trainer.localDisk.size", "pattern"),
    ],
)
def test_bad_local_disks_are_refused_naming_the_field_and_the_fix(
    local_disk: dict[str, Any], trainer: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(ManifestError) as err:
        parse_object(_job(local_disk, **trainer))
    text = str(err.value)
    assert field in text and message in text, text


def test_a_valid_local_disk_loads() -> None:
    job = parse_object(_job({"path": "/mnt/nvme", "source": "hostPath"}, streamOptimizerStateToDisk=True))
    assert job.spec.trainer.local_disk is not None and job.spec.trainer.local_disk.path == "/mnt/nvme"
