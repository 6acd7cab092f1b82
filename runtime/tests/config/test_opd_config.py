"""spec.algorithm.opd -> OPDConfig and TeacherSetup (lockstep.config.opd), golden."""

from __future__ import annotations

from pathlib import Path

import yaml
from lockstep.api import parse_object
from lockstep.config.driver import run_config
from lockstep.config.opd import opd_config, teacher_setup
from lockstep.rollout.opd.config import OPDConfig, TeacherSetup, TeacherSource

EXAMPLE = Path(__file__).parents[3] / "examples" / "tiny-local.yaml"


def _job(opd: dict[str, object] | None) -> object:
    doc = yaml.safe_load(EXAMPLE.read_text())
    if opd is not None:
        doc["spec"]["algorithm"]["opd"] = opd
    return parse_object(doc)


def test_without_opd_there_is_no_config() -> None:
    job = _job(None)
    assert opd_config(job) is None  # type: ignore[arg-type]
    assert teacher_setup(job, seed=0, true_on_policy=False, kv_cache_dtype="auto").sources == ()  # type: ignore[arg-type]


def test_the_manifest_maps_onto_the_configs() -> None:
    job = _job(
        {
            "teachers": [
                {"name": "math", "checkpoint": "/ckpt/math", "replicas": 2, "labels": ["gsm8k", "reverse"]},
                {"name": "code", "url": "http://code:30000", "labels": ["mbpp"]},
                {"name": "any", "url": "http://any:30000"},
            ],
            "defaultTeacher": "any",
            "coef": 0.5,
            "taskReward": "zero",
            "labelKey": "domain",
            "candidates": {"set": "teacher-top-k", "topK": 16, "weight": "teacher"},
        }
    )
    assert opd_config(job) == OPDConfig(  # type: ignore[arg-type]
        teachers=("math", "code", "any"),
        routes={"gsm8k": "math", "reverse": "math", "mbpp": "code"},
        default_teacher="any",
        label_key="domain",
        zero_task_reward=True,
        candidate_set="teacher-top-k",
        top_k=16,
        weight="teacher",
    )
    assert run_config(job).teachers == TeacherSetup(  # type: ignore[arg-type]
        sources=(
            TeacherSource(name="math", checkpoint="/ckpt/math", replicas=2),
            TeacherSource(name="code", url="http://code:30000"),
            TeacherSource(name="any", url="http://any:30000"),
        ),
        seed=0,
        true_on_policy=False,
        kv_cache_dtype="auto",
    )
