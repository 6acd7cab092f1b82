"""settings_from_job: the manifest fields the loop and the trainer read, golden (pure function, no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from lockstep.api import ManifestError, load_manifest
from lockstep.driver.settings import RunSettings, Schedule, settings_from_job
from lockstep.train.common.losses import PolicyLossConfig
from lockstep.train.common.lr_schedule import LRSchedule
from lockstep.train.common.mismatch import MismatchConfig
from lockstep.trainer.settings import TrainerSettings

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-fast.yaml"


def test_golden_settings_of_the_fixture() -> None:
    assert settings_from_job(load_manifest(FIXTURE)) == RunSettings(
        schedule=Schedule(
            steps=3,
            batch_groups=2,
            samples_per_prompt=4,
            update_interval=1,
            save_interval=2,
            eval_interval=None,
        ),
        seed=0,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=6,
        eval_temperature=0.0,
        trainer=TrainerSettings(
            seed=0,
            learning_rate=0.0003,
            grad_clip=1.0,
            micro_batch_size=64,
            temperature=1.0,
            sft_steps=2,
            sft_learning_rate=0.003,
            sft_rows=8,
            sft_stop_at_loss=None,
            loss=PolicyLossConfig(
                estimator="grpo",
                eps_clip_low=0.2,
                eps_clip_high=0.2,
                kl_coef=0.0,
                kl_estimator="k3",
                mismatch=MismatchConfig("off", 0.0, 2.0),
            ),
            lr_schedule=LRSchedule(learning_rate=0.0003, total_steps=3),
        ),
        max_groups_per_step=None,
    )


def test_local_knobs_come_from_typed_fields() -> None:
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"]["algorithm"]["sftWarmStart"] = {"steps": 0}
    doc["spec"]["trainer"] |= {"gradClip": 0.5, "microBatchSize": 8}
    doc["spec"]["schedule"]["evalTemperature"] = 0.7
    s = settings_from_job(load_manifest(yaml.safe_dump(doc)), steps=9)
    assert (s.schedule.steps, s.trainer.sft_steps, s.trainer.sft_learning_rate) == (9, 0, None)
    assert (s.trainer.grad_clip, s.trainer.micro_batch_size, s.eval_temperature) == (0.5, 8, 0.7)


def test_lr_schedule_and_dynamic_sampling_come_from_the_manifest() -> None:
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"]["algorithm"] |= {
        "lrSchedule": {"warmupSteps": 1, "decay": "cosine", "minLearningRate": 1e-5},
        "dynamicSampling": {"maxGroupsPerStep": 6},
    }
    s = settings_from_job(load_manifest(yaml.safe_dump(doc)), steps=2)
    # --steps stops the run early; the schedule still spans spec.schedule.steps (3)
    assert s.trainer.lr_schedule == LRSchedule(
        learning_rate=0.0003, total_steps=3, warmup_steps=1, decay="cosine", min_learning_rate=1e-5
    )
    assert s.max_groups_per_step == 6


@pytest.mark.parametrize(
    ("section", "value", "field"),
    [
        ("trainer", {"gradClip": 0}, "spec.trainer.gradClip"),
        ("trainer", {"microBatchSize": 0}, "spec.trainer.microBatchSize"),
        ("algorithm", {"sftWarmStart": {"steps": -1}}, "spec.algorithm.sftWarmStart.steps"),
        ("algorithm", {"lrSchedule": {"decay": "step"}}, "spec.algorithm.lrSchedule.decay"),
        ("algorithm", {"lrSchedule": {"warmupSteps": -1}}, "spec.algorithm.lrSchedule.warmupSteps"),
        ("algorithm", {"lrSchedule": {"warmupSteps": 3}}, "spec.algorithm.lrSchedule.warmupSteps"),
        (
            "algorithm",
            {"lrSchedule": {"minLearningRate": 0.001}},
            "spec.algorithm.lrSchedule.minLearningRate",
        ),
        ("algorithm", {"sftWarmStart": {"stopAtLoss": 0}}, "spec.algorithm.sftWarmStart.stopAtLoss"),
        (
            "algorithm",
            {"sftWarmStart": {"steps": 0, "stopAtLoss": 0.5}},
            "spec.algorithm.sftWarmStart.stopAtLoss",
        ),
        ("algorithm", {"dynamicSampling": {}}, "spec.algorithm.dynamicSampling.maxGroupsPerStep"),
        (
            "algorithm",
            {"dynamicSampling": {"maxGroupsPerStep": 1}},
            "spec.algorithm.dynamicSampling.maxGroupsPerStep",
        ),
    ],
)
def test_bad_knobs_are_refused_naming_the_field(section: str, value: dict[str, object], field: str) -> None:
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"][section] |= value
    with pytest.raises(ManifestError, match=field.replace(".", r"\.")):
        load_manifest(yaml.safe_dump(doc))
