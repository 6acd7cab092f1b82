"""lockstep.config.driver: the manifest fields the driver reads, golden (pure functions, no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from lockstep.api import ManifestError, load_manifest
from lockstep.config.driver import (
    TERMINAL_AGENT,
    TEST_REWARD,
    EngineSetup,
    RunSettings,
    Schedule,
    run_config,
    run_settings,
)
from lockstep.train.common.losses import PolicyLossConfig
from lockstep.train.common.lr_schedule import LRSchedule
from lockstep.train.common.mismatch import MismatchConfig
from lockstep.trainer.settings import TrainerSettings

FIXTURE = Path(__file__).parents[1] / "driver" / "fixtures" / "tiny-fast.yaml"


def test_golden_settings_of_the_fixture() -> None:
    assert run_settings(load_manifest(FIXTURE)) == RunSettings(
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
    s = run_settings(load_manifest(yaml.safe_dump(doc)), steps=9)
    assert (s.schedule.steps, s.trainer.sft_steps, s.trainer.sft_learning_rate) == (9, 0, None)
    assert (s.trainer.grad_clip, s.trainer.micro_batch_size, s.eval_temperature) == (0.5, 8, 0.7)


def test_lr_schedule_and_dynamic_sampling_come_from_the_manifest() -> None:
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"]["algorithm"] |= {
        "lrSchedule": {"warmupSteps": 1, "decay": "cosine", "minLearningRate": 1e-5},
        "dynamicSampling": {"maxGroupsPerStep": 6},
    }
    s = run_settings(load_manifest(yaml.safe_dump(doc)), steps=2)
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


def test_run_config_reads_each_part_of_the_manifest_once() -> None:
    job = load_manifest(FIXTURE)
    c = run_config(job, steps=2, embedded_engines=True)
    assert (c.job_name, c.sft, c.fully_async, c.job_steps) == (job.metadata.name, False, False, 3)
    assert c.settings == run_settings(job, 2) and c.async_settings.schedule is c.settings.schedule
    assert c.engines == EngineSetup(
        replicas=1,
        wants_gpu=False,
        true_on_policy=False,
        kv_cache_dtype="auto",
        max_lora_rank=None,
        allow_tensor_updates=False,
    )
    assert (c.r3, c.adapter, c.sandbox, c.opd, c.serving) == (False, None, None, None, None)
    assert (c.agent.agent_function, c.agent.reward_function, c.agent.family) == (None, None, "tiny")


def test_a_lora_job_names_its_adapter_and_its_engines_serve_its_rank() -> None:
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"]["model"]["lora"] = {"rank": 8, "alpha": 16}
    c = run_config(load_manifest(yaml.safe_dump(doc)))
    assert (c.adapter, c.engines.max_lora_rank) == (doc["metadata"]["name"], 8)
    doc["spec"]["model"]["lora"]["adapterName"] = "mine"
    assert run_config(load_manifest(yaml.safe_dump(doc))).adapter == "mine"


def test_a_sandbox_job_defaults_to_the_terminal_agent_and_its_test() -> None:
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"].setdefault("agent", {})["sandbox"] = {"image": "busybox:1.36"}
    doc["spec"]["agent"]["maxTurns"] = 4
    c = run_config(load_manifest(yaml.safe_dump(doc)))
    assert (c.agent.agent_function, c.agent.reward_function) == (TERMINAL_AGENT, TEST_REWARD)
    assert c.sandbox is not None and c.sandbox.job_name == doc["metadata"]["name"]
    assert c.sandbox.concurrency >= 1 and c.sandbox.config.image == "busybox:1.36"
    doc["spec"]["agent"]["rewardFunction"] = "my_rewards:score"
    assert run_config(load_manifest(yaml.safe_dump(doc))).agent.reward_function == "my_rewards:score"


def test_an_sft_job_runs_the_sft_loop_without_engines() -> None:
    job = load_manifest(Path(__file__).parents[3] / "examples" / "tiny-sft.yaml")
    c = run_config(job, embedded_engines=True)
    assert c.sft and c.trainer == run_config(job).trainer  # no engines: nothing embedded
