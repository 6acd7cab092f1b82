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
from lockstep.api.rljob import Precision, RLJob, is_hub_id
from lockstep.api.rolloutpool import RolloutPoolSpec
from lockstep.api.trainergroup import TrainerGroupSpec
from lockstep_operator.resources.children import child_manifests
from lockstep_operator.resources.common import Owner
from lockstep_operator.resources.driver import driver_manifest
from lockstep_operator.resources.engines import engine_manifest
from lockstep_operator.resources.model import local_dir, local_model, serving_dir
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
        ("org/../name", False),
        ("org/name@../x", True),  # the revision is the hub's to judge; its directory has no "/"
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


def test_a_revision_never_leaves_the_model_volume() -> None:
    assert local_dir("org/name@../../etc") == "/models/org--name@..--..--etc"
    assert local_dir("org/name@refs/pr/1") == "/models/org--name@refs--pr--1"


def test_the_same_repo_as_tokenizer_is_pulled_once() -> None:
    j = job("Qwen/Qwen3-0.6B", tokenizer="Qwen/Qwen3-0.6B")
    [init] = pods(j)["rank"]["spec"]["initContainers"]
    assert init["command"][:3] == ["lockstep", "pull-model", "Qwen/Qwen3-0.6B"]


# -- low-precision serving: the engine pods' conversion step (§6 stage 1) ----------------------


def quantized(checkpoint: str, precision: str = "fp8", bf16: list[str] | None = None) -> RLJob:
    j = job(checkpoint, bf16Modules=bf16 or [])
    raw = j.model_dump(mode="json", by_alias=True, exclude_none=True)
    raw["spec"]["rollout"]["precision"] = precision
    if precision == "nvfp4":
        raw["spec"]["trainer"]["precision"] = "nvfp4"  # rule nvfp4-serving-needs-nvfp4-training
    return RLJob.model_validate(raw)


@pytest.mark.parametrize("precision", ["fp8", "mxfp8", "nvfp4"])
def test_a_quantized_engine_converts_then_serves_the_converted_checkpoint(precision: str) -> None:
    j = quantized("Qwen/Qwen3-0.6B", precision, bf16=["model.layers.27.*"])
    spec = pods(j)["engine"]["spec"]
    pull, convert = spec["initContainers"]  # the pull first: the conversion reads its files
    assert pull["name"] == "pull-model"
    dest = serving_dir(j.spec.model, j.spec.rollout.precision)
    assert dest.startswith("/serving/" + precision + "-")
    assert convert["name"] == "convert-model" and convert["image"] == IMAGE
    assert convert["command"] == [
        "lockstep", "convert-model", "/models/Qwen--Qwen3-0.6B", "--dest", dest,
        "--precision", precision, "--bf16-modules", "model.layers.27.*",
    ]  # fmt: skip
    assert convert["volumeMounts"] == [
        {"name": "model", "mountPath": "/models"},
        {"name": "serving", "mountPath": "/serving"},
    ]
    assert convert["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert "env" not in convert  # the hub token is the pull's alone
    main = spec["containers"][0]
    assert {"name": "serving", "mountPath": "/serving"} in main["volumeMounts"]
    assert {"name": "serving", "emptyDir": {}} in spec["volumes"]
    cmd = main["command"]  # the reference engine of tiny-local: it checks the flag against the files
    assert cmd[cmd.index("--model") + 1] == dest
    quant_flag = {"fp8": "fp8", "mxfp8": "mxfp8", "nvfp4": "modelopt_fp4"}[precision]
    assert cmd[cmd.index("--quantization") + 1] == quant_flag


@pytest.mark.parametrize("role", ["driver", "rank"])
def test_the_driver_and_the_ranks_keep_the_bf16_checkpoint(role: str) -> None:
    spec = pods(quantized("Qwen/Qwen3-0.6B"))[role]["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["pull-model"]
    assert all(v["name"] != "serving" for v in spec["volumes"])


def test_a_local_checkpoint_is_converted_from_where_it_is() -> None:
    j = quantized("/models/qwen3-0.6b")
    spec = pods(j)["engine"]["spec"]
    [convert] = spec["initContainers"]
    assert convert["command"][2:4] == ["/models/qwen3-0.6b", "--dest"]
    assert convert["volumeMounts"] == [{"name": "serving", "mountPath": "/serving"}]  # /models untouched
    assert all(v["name"] != "model" for v in spec["volumes"])


def test_with_the_jobs_shared_claim_the_serving_checkpoint_is_converted_once_on_it() -> None:
    spec = pods(quantized("Qwen/Qwen3-0.6B"), shared="rl-shared")["engine"]["spec"]
    mount = {"name": "shared", "mountPath": "/serving", "subPath": "lockstep/serving"}
    assert spec["initContainers"][1]["volumeMounts"][-1] == mount
    assert mount in spec["containers"][0]["volumeMounts"]
    assert all(v["name"] != "serving" for v in spec["volumes"])


def test_a_different_recipe_never_reuses_another_conversion() -> None:
    base = quantized("Qwen/Qwen3-0.6B").spec.model
    dirs = {
        serving_dir(base, Precision.FP8),
        serving_dir(base, Precision.MXFP8),
        serving_dir(base.model_copy(update={"bf16_modules": ["*.o_proj"]}), Precision.FP8),
        serving_dir(base.model_copy(update={"checkpoint": "Qwen/Qwen3-4B"}), Precision.FP8),
    }
    assert len(dirs) == 4
    assert serving_dir(base, Precision.FP8) == serving_dir(base.model_copy(), Precision.FP8)  # stable
    assert "initContainers" not in pods(job("/models/qwen3-0.6b"))["engine"]["spec"]  # bf16: nothing


def test_a_new_conversion_layout_never_reuses_an_older_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared claim keeps conversions across runs: one written before the layout changed (e.g.
    expert weights kept BF16) must not be served to engines that receive the new layout."""
    import lockstep_operator.resources.model as model_resources

    base = quantized("Qwen/Qwen3-0.6B").spec.model
    now = serving_dir(base, Precision.NVFP4)
    monkeypatch.setattr(model_resources, "SERVING_LAYOUT", model_resources.SERVING_LAYOUT - 1)
    assert serving_dir(base, Precision.NVFP4) != now


def test_a_reference_engine_reads_disk_updates_only_under_the_jobs_shared_directory() -> None:
    """--weights-root confines /update_weights_from_disk (lockstep.engine.disk_reads); the runtime's
    own parser takes the rendered command."""
    from lockstep.cli import build_parser

    with_shared = pods(job("builtin:tiny"), shared="claim")["engine"]["spec"]["containers"][0]["command"]
    assert with_shared[with_shared.index("--weights-root") + 1] == "/shared/lockstep/j"
    assert build_parser().parse_args(with_shared[1:]).weights_root == ["/shared/lockstep/j"]
    without = pods(job("builtin:tiny"))["engine"]["spec"]["containers"][0]["command"]
    assert "--weights-root" not in without  # no disk transport without a shared volume
