"""The true-on-policy profile registry and the SGLang arguments a job's numerics need (table tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
from lockstep.api import ManifestError, load_manifest
from lockstep.api.profiles import PROFILES, SGLANG_TRUE_ON_POLICY_ARGS, profile_for, sglang_args_for

EXAMPLES = Path(__file__).parents[3] / "examples"


@pytest.mark.parametrize(
    ("family", "variant", "profile"),
    [
        ("tiny", None, "tiny"),
        ("tiny", "anything", "tiny"),
        ("qwen3", "0.6b", "qwen3-dense-small"),
        ("qwen3", "4b", "qwen3-dense-small"),
        ("qwen3", "8b", None),
        ("qwen3", None, None),
        ("glm5", "744b-a40b", None),
    ],
)
def test_profile_lookup(family: str, variant: str | None, profile: str | None) -> None:
    found = profile_for(family, variant)
    assert (found.name if found else None) == profile


def test_every_profile_names_its_kernels_and_switches() -> None:
    for p in PROFILES:
        assert p.attention == "lockstep_exact" and p.matmul and p.sglang_args == SGLANG_TRUE_ON_POLICY_ARGS


def test_sglang_args_follow_the_job_numerics() -> None:
    h100 = load_manifest(EXAMPLES / "h100.yaml")
    assert sglang_args_for(h100.spec) == list(SGLANG_TRUE_ON_POLICY_ARGS)
    glm = load_manifest(EXAMPLES / "glm5-gb300.yaml")
    assert sglang_args_for(glm.spec) == ["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"]
    tiny = load_manifest(EXAMPLES / "tiny-local.yaml")
    assert sglang_args_for(tiny.spec) == []


def test_an_unregistered_model_is_refused_at_apply() -> None:
    text = (EXAMPLES / "h100.yaml").read_text().replace("variant: 4b", "variant: 8b")
    with pytest.raises(ManifestError, match="true-on-policy has profiles only for the models"):
        load_manifest(text)
