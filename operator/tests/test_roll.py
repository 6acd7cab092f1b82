"""Spec changes roll pods: the pod-template hash (what rolls, what never does) and the roll policies.

Pure functions only; the e2e test `e2e/test_operator_roll.py` checks the same against the real
control plane.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml
from lockstep.api.rljob import RLJob, RLJobSpec
from lockstep.api.rolloutpool import RolloutPoolSpec
from lockstep.api.trainergroup import TrainerGroupSpec
from lockstep_operator.policy.roll import EngineState, engines_to_roll
from lockstep_operator.reconcile.status import condition, trainer_status
from lockstep_operator.resources.children import child_manifests, run_config_hash
from lockstep_operator.resources.common import Owner
from lockstep_operator.resources.driver import driver_manifest
from lockstep_operator.resources.engines import engine_manifest
from lockstep_operator.resources.pods import template_hash_of
from lockstep_operator.resources.ranks import rank_manifest

FIXTURES = Path(__file__).parent / "fixtures"
OWNER = Owner(api_version="rl.lockstep.dev/v1alpha1", kind="RLJob", name="j", uid="u", namespace="ns")
NOW = dt.datetime(2026, 12, 2, tzinfo=dt.UTC)


def spec(**patch: Any) -> RLJobSpec:
    """The h100 fixture's spec with top-level sections merged from `patch`."""
    raw = yaml.safe_load((FIXTURES / "h100.yaml").read_text())
    for key, value in patch.items():
        raw["spec"][key] = {**raw["spec"].get(key, {}), **value} if isinstance(value, dict) else value
    return RLJob.model_validate(raw).spec


def hashes(s: RLJobSpec) -> dict[str, str | None]:
    """The pod-template hash of engine 0, rank 0 and the driver rendered from job spec `s`."""
    pool, trainer, _ = child_manifests(OWNER, s, suspended=False, stopped="")
    pool_spec = RolloutPoolSpec.model_validate({**pool["spec"], "replicas": s.rollout.replicas})
    engine = engine_manifest(OWNER, pool_spec, 0, gang_min=s.trainer.nodes + s.rollout.replicas, image="img")
    rank = rank_manifest(
        OWNER,
        TrainerGroupSpec.model_validate(trainer["spec"]),
        0,
        generation=0,
        gang_min=1,
        clique=None,
        image="img",
        config_hash=trainer["metadata"]["annotations"]["rl.lockstep.dev/config-hash"],
    )
    return {
        "engine": template_hash_of(engine),
        "rank": template_hash_of(rank),
        "driver": template_hash_of(driver_manifest(OWNER, s, image="img")),
    }


def test_scale_suspend_and_limits_never_roll_a_pod() -> None:
    base = hashes(spec())
    assert all(base.values())
    assert hashes(spec(rollout={"replicas": 3})) == base
    assert hashes(spec(rollout={"autoscaling": {"minReplicas": 1, "maxReplicas": 16}})) == base
    assert hashes(spec(suspend=True, backoffLimit=9, activeDeadlineSeconds=600)) == base


@pytest.mark.parametrize(
    ("patch", "rolled"),
    [
        ({"rollout": {"image": "engine:v2"}}, {"engine", "rank", "driver"}),  # the run config changed too
        ({"rollout": {"extraArgs": ["--mem-fraction-static", "0.8"]}}, {"engine", "rank", "driver"}),
        ({"trainer": {"image": "trainer:v2"}}, {"rank", "driver"}),
        ({"agent": {"image": "agent:v2"}}, {"rank", "driver"}),
        ({"algorithm": {"learningRate": 2e-6}}, {"rank", "driver"}),
    ],
)
def test_a_spec_change_rolls_the_pods_that_read_it(patch: dict[str, Any], rolled: set[str]) -> None:
    base, after = hashes(spec()), hashes(spec(**patch))
    assert {role for role in base if base[role] != after[role]} == rolled


def test_run_config_hash_ignores_only_operator_fields() -> None:
    assert run_config_hash(spec()) == run_config_hash(spec(suspend=True, rollout={"replicas": 7}))
    assert run_config_hash(spec()) != run_config_hash(spec(schedule={"steps": 7}))


def e(index: int, *, stale: bool = False, ready: bool = True, terminating: bool = False) -> EngineState:
    return EngineState(name=f"p-{index}", index=index, stale=stale, ready=ready, terminating=terminating)


def test_engines_roll_one_at_a_time_waiting_for_the_replacement() -> None:
    # All ready: the lowest stale one goes.
    assert engines_to_roll([e(0, stale=True), e(1, stale=True), e(2)], desired=3, min_ready=2) == ["p-0"]
    # Its replacement is not Ready yet (or not created yet): nothing else goes.
    assert engines_to_roll([e(0, ready=False), e(1, stale=True), e(2)], desired=3, min_ready=2) == []
    assert engines_to_roll([e(1, stale=True), e(2)], desired=3, min_ready=2) == []
    assert (
        engines_to_roll([e(0, stale=True, terminating=True), e(1, stale=True), e(2)], desired=3, min_ready=2)
        == []
    )
    # Replacement Ready: the next one.
    assert engines_to_roll([e(0), e(1, stale=True), e(2)], desired=3, min_ready=2) == ["p-1"]
    assert engines_to_roll([e(0), e(1), e(2)], desired=3, min_ready=2) == []


def test_stale_engines_that_serve_nothing_go_at_once() -> None:
    engines = [e(0, stale=True, ready=False), e(1, stale=True, ready=False), e(2, stale=True)]
    assert engines_to_roll(engines, desired=3, min_ready=1) == ["p-0", "p-1"]


def test_a_pool_without_headroom_rolls_one_engine_down_at_a_time() -> None:
    assert engines_to_roll([e(0, stale=True), e(1, stale=True)], desired=2, min_ready=2) == ["p-0"]
    assert engines_to_roll([e(0, stale=True)], desired=1, min_ready=1) == ["p-0"]


def test_a_spec_change_restart_is_a_condition_not_a_restart() -> None:
    first = trainer_status([], nodes=2, gpus_per_node=1, restarts=0, failed=None, previous=None, step=None,
                           generation=1, now=NOW)  # fmt: skip
    up = condition(first.conditions, "UpToDate")
    assert up is not None and up.reason == "Current"
    rolling = trainer_status([], nodes=2, gpus_per_node=1, restarts=0, failed=None, previous=first, step=None,
                             generation=2, now=NOW, rolling="abc")  # fmt: skip
    up = condition(rolling.conditions, "UpToDate")
    assert (
        up is not None and up.status.value == "False" and up.reason == "SpecChanged" and "abc" in up.message
    )
    assert rolling.restarts == 0
    done = trainer_status([], nodes=2, gpus_per_node=1, restarts=0, failed=None, previous=rolling, step=None,
                          generation=2, now=NOW)  # fmt: skip
    up = condition(done.conditions, "UpToDate")
    assert up is not None and up.status.value == "True" and up.reason == "SpecChanged" and done.restarts == 0
