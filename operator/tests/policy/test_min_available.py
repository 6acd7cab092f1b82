"""min_available, defined once on the API model, and every place that counts a pool's minimum.

The disagreement this pins: with autoscaling.minReplicas 0 the job's readiness wanted one ready
engine, while the gang (PodGroup minMember) and the pool (MinAvailableBreached, the roll's floor)
counted zero. A gang without an engine lets the scheduler place the trainer while every engine waits
(a partial gang), and the job then sits in Provisioning "engines ready 0/1". Now all of them count
min_available: at least one engine while replicas > 0.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml
from lockstep.api.rljob import Autoscaling, RLJob, min_available
from lockstep.api.rolloutpool import RolloutPoolSpec
from lockstep_operator.policy.job_observed import JobObserved
from lockstep_operator.policy.job_phase import pods_ready
from lockstep_operator.reconcile.status import pool_status
from lockstep_operator.resources.podgroups import gang_min_member

FIXTURES = Path(__file__).parent.parent / "fixtures"


@pytest.mark.parametrize(
    ("replicas", "autoscaling", "want"),
    [
        (3, None, 3),
        (3, Autoscaling(min_replicas=2, max_replicas=4), 2),
        (3, Autoscaling(min_replicas=0, max_replicas=4), 1),  # the job needs an engine
        (1, Autoscaling(min_replicas=1, max_replicas=4), 1),
        (0, None, 0),
        (0, Autoscaling(min_replicas=0, max_replicas=4), 0),
    ],
    ids=["pinned", "autoscaled", "scale-to-zero-bound", "one", "no-engines", "zero-and-zero"],
)
def test_min_available_table(replicas: int, autoscaling: Autoscaling | None, want: int) -> None:
    assert min_available(replicas, autoscaling) == want


def test_gang_pool_and_job_readiness_agree_when_min_replicas_is_zero() -> None:
    raw: dict[str, Any] = yaml.safe_load((FIXTURES / "tiny-local.yaml").read_text())
    raw["spec"]["rollout"].update({"replicas": 2, "autoscaling": {"minReplicas": 0, "maxReplicas": 4}})
    spec = RLJob.model_validate(raw).spec
    pool = RolloutPoolSpec.model_validate(
        {
            "job": "j",
            "replicas": 2,
            "autoscaling": raw["spec"]["rollout"]["autoscaling"],
            "model": raw["spec"]["model"],
        }
    )
    # The job waits for one engine ...
    obs = JobObserved(None, None, None, None, None, "Running", None)
    ready, missing = pods_ready(spec, obs)
    assert not ready and "engines ready 0/1" in missing
    # ... so the gang holds one engine (before: trainer nodes + 0) ...
    assert gang_min_member(spec) == spec.trainer.nodes + 1
    # ... and the pool reports the breach of the same minimum (before: never breached).
    now = dt.datetime(2026, 12, 2, tzinfo=dt.UTC)
    status = pool_status(
        [], selector="a=b", current_version=None, engine_versions={}, min_available=pool.min_available,
        previous=None, generation=1, now=now,
    )  # fmt: skip
    breached = next(c for c in status.conditions if c.type == "MinAvailableBreached")
    assert pool.min_available == spec.rollout.min_available == 1
    assert breached.status.value == "True" and breached.message == "0 ready, minimum 1"
