"""lockstep.train.factory: the manifest's trainer.backend picks the backend (through
lockstep.config.trainer); what cannot run says why."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from lockstep.api import RLJob, load_manifest
from lockstep.config.trainer import backend_config
from lockstep.models.tiny import materialize_builtin
from lockstep.train.factory import build_backend

EXAMPLES = Path(__file__).parents[3] / "examples"


def _job(name: str, rollout: dict[str, object] | None = None, **trainer: object) -> RLJob:
    doc = yaml.safe_load((EXAMPLES / name).read_text())
    doc["spec"]["trainer"].update(trainer)
    doc["spec"]["rollout"].update(rollout or {})
    return load_manifest(yaml.safe_dump(doc))


def test_fsdp_is_built_from_the_manifest(tmp_path: Path) -> None:
    from lockstep.train.fsdp import FSDPBackend

    path = materialize_builtin("builtin:tiny", tmp_path, seed=0)
    config = backend_config(_job("tiny-local.yaml", microBatchSize=4))
    backend = build_backend(config, path)
    try:
        assert isinstance(backend, FSDPBackend)
        assert backend.config.offload == "none" and backend.config.micro_batch_size == 4
    finally:
        backend.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_megatron_without_cuda_is_refused_naming_the_fields(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    path = materialize_builtin("builtin:tiny", tmp_path, seed=0)
    job = _job("tiny-megatron.yaml")
    with pytest.raises(
        RuntimeError,
        match=r"needs CUDA .*set trainer\.device to cuda on a GPU node, or trainer\.backend to fsdp",
    ):
        build_backend(backend_config(job), path)


def test_megatron_trains_bf16_only_refused_at_apply() -> None:
    from lockstep.api import ManifestError

    with pytest.raises(
        ManifestError, match=r"spec\.trainer\.precision: \"fp8\": the megatron backend trains bf16"
    ):
        _job("tiny-megatron.yaml", rollout={"precision": "fp8"}, precision="fp8")  # serving matches


@pytest.mark.parametrize("fixture", ["qwen3", "qwen3-moe", "glm5"])
def test_the_apply_rules_megatron_families_are_what_the_backend_builds(
    fixture: str, hf_checkpoint: Callable[[str], Path]
) -> None:
    """Rule megatron-families-built refuses at apply exactly the families whose architecture the
    megatron backend refuses at start (checked on each family's real HF-layout fixture)."""
    import json

    from hf_checkpoints import FAMILIES
    from lockstep.api.rules import MEGATRON_FAMILIES
    from lockstep.train.megatron.config import SUPPORTED_ARCHITECTURES

    config = json.loads((hf_checkpoint(fixture) / "config.json").read_text())
    built = config["architectures"][0] in SUPPORTED_ARCHITECTURES
    assert (FAMILIES[fixture]["family"] in MEGATRON_FAMILIES) == built, (fixture, config["architectures"])
