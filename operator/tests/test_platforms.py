"""GPU product labels and image architectures from the operator settings, and the node affinity every
pod gets from them (resources.platforms). The scheduler's side is e2e/test_image_placement.py."""

from __future__ import annotations

import pytest
from lockstep_operator.resources.platforms import ImageArchitectureError, NodeFacts, default_facts
from lockstep_operator.resources.pods import Container, Placement, with_architectures
from lockstep_operator.settings import OperatorSettings, settings_from_env

RULES = NodeFacts(
    image_rules=(
        ("ghcr.io/lockstep/", ("amd64", "arm64")),
        ("ghcr.io/lockstep/lockstep-engine", ("amd64",)),
        ("registry.example/arm/", ("arm64",)),
    ),
    default_architectures=("amd64",),
)


@pytest.mark.parametrize(
    ("images", "arches"),
    [
        (["ghcr.io/lockstep/lockstep-runtime:0.1.0"], ("amd64", "arm64")),
        (["ghcr.io/lockstep/lockstep-engine:0.1.0"], ("amd64",)),  # the longest prefix wins
        (["docker.io/library/python:3.11"], ("amd64",)),  # no rule: the default
        (["registry.example/arm/trainer:1"], ("arm64",)),
        (["ghcr.io/lockstep/lockstep-runtime:0.1.0", "registry.example/arm/x:1"], ("arm64",)),  # init + main
        (["ghcr.io/lockstep/lockstep-engine:0.1.0", "registry.example/arm/x:1"], ()),  # nothing in common
        ([], ("amd64", "arm64")),
    ],
)
def test_pod_architectures_table(images: list[str], arches: tuple[str, ...]) -> None:
    assert RULES.pod_architectures(images) == arches


def test_images_without_a_common_architecture_are_refused_naming_them() -> None:
    container = Container(image="registry.example/arm/trainer:1", command=["x"])
    assert with_architectures(Placement(), container, RULES).architectures == ("arm64",)
    engine = Container(image="ghcr.io/lockstep/lockstep-engine:0.1.0", command=["x"])
    facts = NodeFacts(
        image_rules=(("ghcr.io/lockstep/lockstep-engine", ("arm64",)),), default_architectures=("amd64",)
    )
    from lockstep_operator.resources.model import ModelPull

    pulled = Container(image=engine.image, command=["x"], model=ModelPull(refs=("org/m",), image="other:1"))
    with pytest.raises(ImageArchitectureError, match="LOCKSTEP_OPERATOR_IMAGE_ARCHITECTURES") as err:
        with_architectures(Placement(), pulled, facts)
    assert "other:1" in str(err.value)


def test_defaults_keep_todays_gpu_labels_and_make_the_release_images_multi_arch() -> None:
    facts = OperatorSettings().node_facts()
    assert facts == default_facts()
    assert facts.product_label("GB300") == "NVIDIA-GB300"
    assert facts.product_label("H100") == "NVIDIA-H100-80GB-HBM3"
    assert facts.product_label("any") is None
    assert facts.image_architectures("ghcr.io/lockstep/lockstep-runtime:0.1.0") == ("amd64", "arm64")
    assert facts.image_architectures("lockstep.local/runtime:abc") == ("amd64",)


def test_settings_from_the_environment() -> None:
    s = settings_from_env(
        {
            "LOCKSTEP_OPERATOR_GPU_PRODUCTS": "GB300=NVIDIA-GB300-SXM, H100=NVIDIA-H100-SXM5-80GB",
            "LOCKSTEP_OPERATOR_IMAGE_ARCHITECTURES": "ghcr.io/lockstep/=amd64|arm64,nvcr.io/=arm64",
            "LOCKSTEP_OPERATOR_DEFAULT_IMAGE_ARCHITECTURES": "arm64,amd64",
        }
    )
    facts = s.node_facts()
    assert facts.product_label("GB300") == "NVIDIA-GB300-SXM"
    assert facts.product_label("H100") == "NVIDIA-H100-SXM5-80GB"
    assert facts.image_architectures("nvcr.io/nvidia/pytorch:25.01") == ("arm64",)
    assert facts.default_architectures == ("amd64", "arm64")


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("GPU_PRODUCTS", "B200=NVIDIA-B200", "PRODUCT one of GB300, H100"),
        ("GPU_PRODUCTS", "GB300", "PRODUCT=LABEL"),
        ("GPU_PRODUCTS", "GB300=NVIDIA GB300", "not a Kubernetes label value"),
        ("IMAGE_ARCHITECTURES", "ghcr.io/x/=amd64|riscv64", "some of amd64, arm64"),
        ("IMAGE_ARCHITECTURES", "ghcr.io/x/", "IMAGE_PREFIX=ARCH|ARCH"),
        ("DEFAULT_IMAGE_ARCHITECTURES", "x86_64", "some of amd64, arm64"),
    ],
)
def test_bad_settings_name_the_variable_and_the_form(variable: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"LOCKSTEP_OPERATOR_{variable}") as err:
        settings_from_env({f"LOCKSTEP_OPERATOR_{variable}": value})
    assert message in str(err.value)


def test_a_configured_product_label_selects_the_nodes_of_rank_and_engine_pods() -> None:
    from lockstep.api.rolloutpool import RolloutPoolSpec
    from lockstep.api.trainergroup import TrainerGroupSpec
    from lockstep_operator.resources.common import Owner
    from lockstep_operator.resources.engines import engine_manifest
    from lockstep_operator.resources.ranks import rank_manifest

    facts = settings_from_env({"LOCKSTEP_OPERATOR_GPU_PRODUCTS": "GB300=Custom-GB300"}).node_facts()
    owner = Owner("rl.lockstep.dev/v1alpha1", "X", "j", "u", "ns")
    place = {"gpuProduct": "GB300"}
    group = TrainerGroupSpec.model_validate(
        {"job": "j", "model": {"checkpoint": "/m", "family": "qwen3"}, "placement": place}
    )
    rank = rank_manifest(
        owner, group, 0, generation=0, gang_min=0, clique=None, image="ghcr.io/lockstep/r:1", facts=facts
    )
    assert rank["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "Custom-GB300"
    pool = RolloutPoolSpec.model_validate(
        {"job": "j", "model": {"checkpoint": "/m", "family": "qwen3"}, "placement": place}
    )
    engine = engine_manifest(owner, pool, 0, gang_min=0, image="ghcr.io/lockstep/e:1", facts=facts)
    assert engine["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "Custom-GB300"
