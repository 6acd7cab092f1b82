"""The model volume of a hub checkpoint: every pod of the job gets one init step, the token reaches only it.

Table tests of the builders in resources/ (driver, rank, engine pods) for local, builtin and hub
checkpoints, with and without a token Secret and a shared claim, and of the local paths the runtime and
SGLang read instead of the repo id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from lockstep.api import load_manifest
from lockstep.api.rljob import RLJob, is_hub_id
from lockstep.api.rolloutpool import RolloutPoolSpec
from lockstep.api.trainergroup import TrainerGroupSpec
from lockstep_operator.resources.children import child_manifests
from lockstep_operator.resources.common import Owner
from lockstep_operator.resources.driver import driver_manifest
from lockstep_operator.resources.engines import engine_manifest
from lockstep_operator.resources.model import local_dir, local_model
from lockstep_operator.resources.ranks import rank_manifest

IMAGE = "registry.example/lockstep-runtime:test"
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize(
    ("ref", "hub"),
    [
        ("Qwen/Qwen3-4B", True),
        ("zai-org/GLM-4.7@main", True),
        ("org/name@0123abcd", True),
        ("org/name@refs/pr/1", True),
        ("/models/qwen3-4b", False),
        ("builtin:tiny", False),
        ("./org/name", False),
        ("org/name/extra", False),
        ("qwen3", False),
        ("org/name@", False),
    ],
)
def test_what_reads_as_a_hub_id(ref: str, hub: bool) -> None:
    assert is_hub_id(ref) is hub


def job(checkpoint: str, **model: Any) -> RLJob:
    raw = yaml.safe_load((FIXTURES / "tiny-local.yaml").read_text())
    raw["spec"]["model"] |= {"checkpoint": checkpoint, **model}
    return RLJob.model_validate(raw)


def owner(kind: str, name: str) -> Owner:
    return Owner(api_version="rl.lockstep.dev/v1alpha1", kind=kind, name=name, uid="u", namespace="team-a")


def pods(j: RLJob, shared: str | None = None) -> dict[str, dict[str, Any]]:
    """The driver, rank 0 and engine 0 of `j` as the operator renders them."""
    own = owner("RLJob", "j")
    pool, trainer, _ = child_manifests(own, j.spec, suspended=False, stopped="", clique="", avoid_clique="")
    pool_spec = RolloutPoolSpec.model_validate(pool["spec"])
    trainer_spec = TrainerGroupSpec.model_validate(trainer["spec"])
    return {
        "driver": driver_manifest(own, j.spec, image=IMAGE),
        "rank": rank_manifest(
            owner("TrainerGroup", "j-trainer"), trainer_spec, 0, generation=0, gang_min=1, clique=None,
            image=IMAGE, shared_volume=shared,
        ),
        "engine": engine_manifest(
            owner("RolloutPool", "j-rollout"), pool_spec, 0, gang_min=1, image=IMAGE, shared_volume=shared
        ),
    }  # fmt: skip


ROLES = ["driver", "rank", "engine"]


@pytest.mark.parametrize("checkpoint", ["builtin:tiny", "/models/qwen3-0.6b"])
@pytest.mark.parametrize("role", ROLES)
def test_a_local_checkpoint_adds_no_init_step(checkpoint: str, role: str) -> None:
    spec = pods(job(checkpoint))[role]["spec"]
    assert "initContainers" not in spec
    assert all(v["name"] != "model" for v in spec["volumes"])
    assert local_model(job(checkpoint).spec.model) == job(checkpoint).spec.model


@pytest.mark.parametrize("role", ROLES)
def test_a_hub_checkpoint_is_pulled_once_per_volume_into_the_model_volume(role: str) -> None:
    spec = pods(job("Qwen/Qwen3-0.6B@main"))[role]["spec"]
    [init] = spec["initContainers"]
    assert init["name"] == "pull-model" and init["image"] == IMAGE  # the runtime image, even for SGLang
    assert init["command"] == [
        "lockstep",
        "pull-model",
        "Qwen/Qwen3-0.6B@main",
        "--dest",
        "/models/Qwen--Qwen3-0.6B@main",
    ]
    assert init["volumeMounts"] == [{"name": "model", "mountPath": "/models"}]
    assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert init["securityContext"]["allowPrivilegeEscalation"] is False
    assert "env" not in init  # no token asked for, none given
    main = spec["containers"][0]
    assert {"name": "model", "mountPath": "/models"} in main["volumeMounts"]
    assert {"name": "model", "emptyDir": {}} in spec["volumes"]


def test_the_engine_serves_and_job_yaml_names_the_local_directory() -> None:
    j = job("Qwen/Qwen3-0.6B")
    cmd = pods(j)["engine"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--model") + 1] == "/models/Qwen--Qwen3-0.6B"  # the reference engine of tiny-local
    local = local_model(j.spec.model)
    assert (local.checkpoint, local.family) == ("/models/Qwen--Qwen3-0.6B", j.spec.model.family)
    # job.yaml as the RLJob reconcile renders it: the pods' own loader accepts it
    rendered = {"apiVersion": j.api_version, "kind": "RLJob", "metadata": {"name": "j"},
                "spec": j.spec.model_copy(update={"model": local}).wire()}  # fmt: skip
    assert load_manifest(yaml.safe_dump(rendered)).spec.model.checkpoint == "/models/Qwen--Qwen3-0.6B"


@pytest.mark.parametrize("role", ROLES)
def test_the_hub_token_reaches_only_the_init_step_by_reference(role: str) -> None:
    j = job("org/private", hubTokenSecret={"name": "hf-token"})
    spec = pods(j)[role]["spec"]
    [init] = spec["initContainers"]
    ref = {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert init["env"] == [{"name": "HF_TOKEN", "valueFrom": ref}]
    main = spec["containers"][0]
    assert all(e["name"] != "HF_TOKEN" for e in main["env"])
    assert "hf-token" not in yaml.safe_dump(main)
    custom = job("org/private", hubTokenSecret={"name": "hf", "key": "HF_TOKEN"})
    assert pods(custom)[role]["spec"]["initContainers"][0]["env"][0]["valueFrom"] == {
        "secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}
    }


@pytest.mark.parametrize("role", ["rank", "engine"])
def test_with_the_jobs_shared_claim_the_model_is_filled_once_on_it(role: str) -> None:
    spec = pods(job("Qwen/Qwen3-0.6B"), shared="rl-shared")[role]["spec"]
    mount = {"name": "shared", "mountPath": "/models", "subPath": "lockstep/models"}
    assert spec["initContainers"][0]["volumeMounts"] == [mount]
    assert mount in spec["containers"][0]["volumeMounts"]
    assert all(v["name"] != "model" for v in spec["volumes"])  # no per-pod copy


def test_a_tokenizer_from_another_repo_is_pulled_too() -> None:
    j = job("Qwen/Qwen3-0.6B", tokenizer="Qwen/Qwen3-4B@v1")
    [init] = pods(j)["driver"]["spec"]["initContainers"]
    assert init["command"] == [
        "sh",
        "-c",
        "lockstep pull-model Qwen/Qwen3-0.6B --dest /models/Qwen--Qwen3-0.6B && "
        "lockstep pull-model Qwen/Qwen3-4B@v1 --dest /models/Qwen--Qwen3-4B@v1",
    ]
    local = local_model(j.spec.model)
    assert (local.checkpoint, local.tokenizer) == (
        local_dir("Qwen/Qwen3-0.6B"),
        local_dir("Qwen/Qwen3-4B@v1"),
    )


def test_the_same_repo_as_tokenizer_is_pulled_once() -> None:
    j = job("Qwen/Qwen3-0.6B", tokenizer="Qwen/Qwen3-0.6B")
    [init] = pods(j)["rank"]["spec"]["initContainers"]
    assert init["command"][:3] == ["lockstep", "pull-model", "Qwen/Qwen3-0.6B"]
