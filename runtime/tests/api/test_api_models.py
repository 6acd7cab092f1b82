"""The API models: seed defaults, camelCase wire form, unknown fields refused, no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from lockstep.api import (
    MismatchCorrection,
    RLJob,
    RLJobSpec,
    ScheduleMode,
    Transport,
    load_manifest,
)
from pydantic import ValidationError

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
MINIMAL = {"model": {"checkpoint": "builtin:tiny", "family": "tiny"}, "data": {"prompts": "builtin:reverse"}}


def test_seed_defaults() -> None:
    spec = RLJobSpec.model_validate(MINIMAL)
    a, w, s = spec.algorithm, spec.weight_sync, spec.schedule
    assert (a.mismatch.correction, a.mismatch.low, a.mismatch.high) == (MismatchCorrection.OFF, 0.0, 2.0)
    assert (a.r3, a.true_on_policy, a.opd) == (False, False, None)
    assert (w.transport, w.bucket_mib, w.update_interval, w.check_weight_update_equal) == (
        Transport.AUTO,
        512,
        1,
        False,
    )
    assert (w.disk_delta.encoding, w.disk_delta.zstd_level, w.disk_delta.checksum) == ("xor", 1, "xxh3-128")
    assert (s.mode, s.colocate, s.max_weight_staleness) == (ScheduleMode.SYNC, False, None)
    assert (spec.rollout.session.mode, spec.rollout.session.matcher) == ("linear", "strict")
    assert spec.weight_sync.pause_mode == "retract"


def test_wire_form_is_camel_case_and_both_names_are_accepted() -> None:
    spec = RLJobSpec.model_validate({**MINIMAL, "weightSync": {"bucketMiB": 256}})
    wire = spec.wire()
    assert wire["weightSync"]["bucketMiB"] == 256
    assert "maxWeightStaleness" not in wire["schedule"]  # unset stays absent, as in the cluster
    assert (
        RLJobSpec.model_validate({**MINIMAL, "weight_sync": {"bucket_mib": 256}}).weight_sync.bucket_mib
        == 256
    )
    assert RLJobSpec.model_validate(wire) == spec


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(ValidationError, match="extra"):
        RLJobSpec.model_validate({**MINIMAL, "rollout": {"replica": 2}})


def test_load_manifest_returns_the_typed_job() -> None:
    job = load_manifest(EXAMPLES / "tiny-local.yaml")
    assert isinstance(job, RLJob)
    assert (job.metadata.name, job.spec.model.checkpoint, job.spec.data.prompts) == (
        "tiny-local",
        "builtin:tiny-deep",
        "builtin:reverse",
    )
    assert (job.spec.rollout.engine, job.spec.trainer.backend, job.spec.trainer.device) == (
        "reference",
        "fsdp",
        "cpu",
    )
    assert load_manifest((EXAMPLES / "tiny-local.yaml").read_text()) == job


def test_gb300_example_has_the_seed_jobs_layout() -> None:
    job = load_manifest(EXAMPLES / "glm5-gb300.yaml").spec
    r, t = job.rollout, job.trainer
    assert r.replicas * r.gpus_per_engine + t.nodes * t.gpus_per_node == 64
    assert (r.precision, r.kv_cache_dtype, r.data_parallel_attention, r.max_in_flight) == (
        "fp8",
        "fp8_e4m3",
        4,
        128,
    )
    assert (job.algorithm.batch_size, job.algorithm.samples_per_prompt) == (8, 8)
    assert (job.algorithm.mismatch.correction, job.algorithm.r3, t.precision) == ("tis", False, "bf16")
    assert (job.schedule.mode, job.schedule.eval_interval, t.backend) == ("fully-async", 10, "fsdp")


def test_api_imports_no_torch_or_numpy() -> None:
    code = (
        "import sys, lockstep.api, lockstep.api.crdgen; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
