"""What the TrainerGroup reconcile hands the gang policy: a rank pod as `RankPod` (rank, generation,
template, how it ended and why), then the policy's decision for the pods of a run.

Pure parts of reconcile/trainergroup.py on rendered rank pods; e2e/test_operator_reconcile.py runs the
whole reconcile against the real control plane (a deleted rank restarts the gang).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from lockstep.api.rljob import RLJob
from lockstep.api.trainergroup import TrainerGroupSpec
from lockstep_operator.policy.gang_restart import gang_restart
from lockstep_operator.reconcile.trainergroup import _observed
from lockstep_operator.resources.children import child_manifests
from lockstep_operator.resources.common import Owner
from lockstep_operator.resources.pods import template_hash_of
from lockstep_operator.resources.ranks import rank_manifest

OWNER = Owner(api_version="rl.lockstep.dev/v1alpha1", kind="RLJob", name="j", uid="u", namespace="ns")
FIXTURE = Path(__file__).parent / "fixtures" / "h100.yaml"


def ranks(generation: int = 0) -> list[dict[str, Any]]:
    """The h100 fixture's rank pods of `generation` on two nodes, as the reconcile renders them."""
    raw = yaml.safe_load(FIXTURE.read_text())
    raw["spec"]["trainer"]["nodes"] = 2
    job = RLJob.model_validate(raw)
    _, trainer, _ = child_manifests(OWNER, job.spec, suspended=False, stopped="", clique="", avoid_clique="")
    spec = TrainerGroupSpec.model_validate(trainer["spec"])
    return [
        rank_manifest(OWNER, spec, r, generation=generation, gang_min=1, clique=None, image="img")
        for r in range(spec.trainer.nodes)
    ]


def ended(pod: dict[str, Any], phase: str, exit_code: int, reason: str) -> dict[str, Any]:
    term = {"exitCode": exit_code, "reason": reason}
    return {**pod, "status": {"phase": phase, "containerStatuses": [{"state": {"terminated": term}}]}}


def test_a_rank_that_exited_0_is_observed_as_succeeded_and_named() -> None:
    pods = ranks()
    expected = {r: template_hash_of(p) for r, p in enumerate(pods)}
    name = pods[1]["metadata"]["name"]
    seen = _observed(ended(pods[1], "Succeeded", 0, "Completed"), expected)
    assert (seen.rank, seen.generation, seen.current_template) == (1, 0, True)
    assert seen.succeeded and not seen.failed
    assert seen.why == f"rank 1 (pod {name}) exited 0 before the job completed"
    failed = _observed(ended(pods[1], "Failed", 1, "Error"), expected)
    assert failed.failed and failed.why == f"rank 1 (pod {name}) failed: Error (exit 1)"
    assert not _observed(pods[0], expected).succeeded


def test_rank_0_deleted_and_rank_1_exited_0_restart_the_gang_unless_the_driver_was_done() -> None:
    """The reported bug: rank 0's pod deleted, rank 1 exits 0; the gang used to wait for a replacement
    rank 0 alone. Mid-run that is a counted restart naming both; after `done` it is the job's end."""
    pods = ranks()
    expected = {r: template_hash_of(p) for r, p in enumerate(pods)}
    seen = [_observed(ended(p, "Succeeded", 0, "Completed"), expected) for p in pods[1:]]
    args: dict[str, Any] = dict(
        ranks=len(pods), restarts=0, limit=3, stopped=False, failed=None, complete=True
    )
    mid_run = gang_restart(seen, done=False, **args)
    assert mid_run.restarts == 1 and mid_run.delete == tuple(p["metadata"]["name"] for p in pods[1:])
    assert mid_run.faults[0] == "rank 0's pod was deleted" and "exited 0" in mid_run.faults[-1]
    at_end = gang_restart(seen, done=True, **args)
    assert (at_end.restarts, at_end.delete, at_end.faults) == (0, (), ())
