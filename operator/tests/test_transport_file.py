"""The WeightChannel's transport choice reaches the trainer ranks through the job's config ConfigMap.

The RLJob reconcile copies the channel's status.transport and reason into `transport.json` of
`<job>-config` (lockstep_operator.resources.config); rank 0 of `lockstep trainer --serve` reads it
from /etc/lockstep (lockstep.api.transport_choice). These tests pin the document (golden), its
round trip through the runtime's reader, and the two properties that let it reach running pods
without a restart: the rank pods mount the ConfigMap as a directory (a subPath or items mount is
never refreshed by the kubelet), and job.yaml, which the pod-template hash covers, does not change.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from lockstep.api import DEFAULT_TRANSPORT_FILE, TRANSPORT_KEY, load_transport_choice
from lockstep.api.rljob import RLJob
from lockstep.api.trainergroup import TrainerGroupSpec
from lockstep.api.weightchannel import WeightChannelStatus
from lockstep_operator.resources import config
from lockstep_operator.resources.children import child_manifests
from lockstep_operator.resources.common import Owner
from lockstep_operator.resources.podgroups import gang_min_member
from lockstep_operator.resources.ranks import rank_manifest

GOLDEN = Path(__file__).parent / "golden"
IMAGE = "registry.example/lockstep-runtime:test"


def owner(kind: str, name: str) -> Owner:
    return Owner(
        api_version="rl.lockstep.dev/v1alpha1", kind=kind, name=name, uid=f"uid-{name}", namespace="team-a"
    )


def check(name: str, value: Any) -> None:
    """Compare with operator/tests/golden/<name>.yaml (LOCKSTEP_UPDATE_GOLDEN=1 rewrites it)."""
    text = yaml.safe_dump(value, sort_keys=True)
    path = GOLDEN / f"{name}.yaml"
    if os.environ.get("LOCKSTEP_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}: run with LOCKSTEP_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name} differs from {path}"


CHOSEN = WeightChannelStatus.model_validate(
    {"transport": "broadcast", "reason": "one network without RDMA: broadcast", "observedGeneration": 3}
)


def test_config_map_carries_the_channel_choice() -> None:
    own = owner("RLJob", "j")
    choice = config.transport_choice(CHOSEN)
    assert choice is not None and choice.transport == "broadcast" and choice.observed_generation == 3
    with_choice = config.runtime_config_map(own, job="j", rendered={"spec": {"a": 1}}, transport=choice)
    check("config-transport", with_choice)
    without = config.runtime_config_map(own, job="j", rendered={"spec": {"a": 1}})
    assert TRANSPORT_KEY not in without["data"]
    # job.yaml (what the pod-template hash covers) is the same with or without the choice.
    assert with_choice["data"]["job.yaml"] == without["data"]["job.yaml"]


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (None, None),
        (WeightChannelStatus(), None),
        (WeightChannelStatus.model_validate({"reason": "waiting for pods"}), None),
        (WeightChannelStatus.model_validate({"transport": "p2p"}), ("p2p", config.DEFAULT_REASON)),
        (CHOSEN, ("broadcast", "one network without RDMA: broadcast")),
    ],
)
def test_transport_choice_only_once_chosen(
    status: WeightChannelStatus | None, expected: tuple[str, str] | None
) -> None:
    choice = config.transport_choice(status)
    assert (None if choice is None else (choice.transport, choice.reason)) == expected


def test_document_round_trips_through_the_runtime_reader(tmp_path: Path) -> None:
    choice = config.transport_choice(CHOSEN)
    cm = config.runtime_config_map(owner("RLJob", "j"), job="j", rendered={}, transport=choice)
    path = tmp_path / TRANSPORT_KEY
    path.write_text(cm["data"][TRANSPORT_KEY])
    assert load_transport_choice(path) == choice


def test_rank_pods_mount_the_config_map_as_a_refreshed_directory() -> None:
    fixture = Path(__file__).parent / "fixtures" / "h100.yaml"
    job = RLJob.model_validate(yaml.safe_load(fixture.read_text()))
    _, trainer, _ = child_manifests(owner("RLJob", "h100"), job.spec, suspended=False, stopped="")
    pod = rank_manifest(
        owner("TrainerGroup", "h100-trainer"),
        TrainerGroupSpec.model_validate(trainer["spec"]),
        0,
        generation=0,
        gang_min=gang_min_member(job.spec),
        clique="",
        image=IMAGE,
        config_hash="0" * 16,
    )
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "config"]
    assert volume["configMap"] == {"name": "h100-config"}  # every key, no items list
    mounts = [m for c in pod["spec"]["containers"] for m in c["volumeMounts"] if m["name"] == "config"]
    assert mounts and all(m["mountPath"] == str(DEFAULT_TRANSPORT_FILE.parent) for m in mounts)
    assert all("subPath" not in m for m in mounts)  # a subPath mount would never see transport.json
    env = {e["name"]: e.get("value") for c in pod["spec"]["containers"] for e in c["env"]}
    assert env["LOCKSTEP_ROLE"] == "trainer"  # rank 0 waits for the file in a pod


def test_job_yaml_is_the_rendering_each_time_though_remembered() -> None:
    """job.yaml is remembered per rendering (the YAML emitter is slow): the same rendering gives the
    same text, any change a new one, and the text is always yaml.safe_dump of the rendering."""
    own = owner("RLJob", "j")
    first = {"spec": {"a": 1, "b": [1, 2]}}
    changed = {"spec": {"a": 2, "b": [1, 2]}}
    for rendered in (first, changed, first):
        cm = config.runtime_config_map(own, job="j", rendered=rendered)
        assert cm["data"]["job.yaml"] == yaml.safe_dump(rendered, sort_keys=True)
    assert (
        yaml.safe_load(config.runtime_config_map(own, job="j", rendered=changed)["data"]["job.yaml"])
        == changed
    )
