"""The progress channel's contract: the document the driver writes and the operator reads.

Why it exists: pods get no broad RBAC. The driver (which owns the loop and the buffer) may only
get/patch one ConfigMap, `<job>-progress`; it writes one JSON document under the key `progress.json`
after the init step (with the pre-flight result) and after each step, or its error when it cannot
start; a trainer rank that cannot start writes its error under its own key `rank-<r>.json`. The
operator folds them into the status of the RLJob (step, version, reward, staleness, queue size, or
Failed with the error), the RolloutPool (per-engine versions) and the WeightChannel (pre-flight
result, last update). Both sides import this module, so
it lives in lockstep.api (pydantic only, no torch) rather than in the operator or the driver.

Who calls it: lockstep.progress (writes, `ProgressReport.to_json`), the operator's reconciles
(`lockstep_operator.reconcile.progress.read_progress`), and the e2e tests.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PROGRESS_KEY = "progress.json"
"""The ConfigMap data key holding the driver's document."""
RANK_KEY_PREFIX = "rank-"
"""Trainer rank r reports under its own key `rank-<r>.json` (rank_key): only when it cannot start."""


class ProgressReport(BaseModel):
    """One progress document from the driver (camelCase on the wire)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, use_attribute_docstrings=True)

    step: int | None = Field(default=None, ge=0)
    """Optimizer steps done; 0 after the init step."""
    weight_version: int | None = Field(default=None, ge=0, alias="weightVersion")
    """The latest published weight version (the one every engine must hold to count as Ready)."""
    reward: float | None = None
    """Moving average of the raw reward."""
    staleness: int | None = Field(default=None, ge=0)
    """Largest staleness S_old of the groups of the last step."""
    avg_staleness: float | None = Field(default=None, ge=0.0, alias="avgStaleness")
    """Token-weighted mean staleness of the last step."""
    queue_size: int | None = Field(default=None, ge=0, alias="queueSize")
    """Complete groups waiting in the async buffer."""
    queue_capacity: int | None = Field(default=None, ge=1, alias="queueCapacity")
    """The buffer's capacity in groups (the autoscaler compares queueSize with it)."""
    engine_versions: dict[str, int] = Field(default_factory=dict, alias="engineVersions")
    """Engine pod name -> the weight version that engine reports (SGLang `weight_version`)."""
    engine_address_versions: dict[str, int] | None = Field(default=None, alias="engineAddressVersions")
    """Engine address `<pod IP>:<port>` -> the weight version that engine reports; unset when the
    driver did not ask. The driver asks every address of the pool's headless Service (it knows
    addresses, not pod names); the operator maps them to pods by pod IP."""
    preflight: Literal["passed", "failed"] | None = None
    """Result of the weight-equality pre-flight check; None while it has not run."""
    preflight_mismatched: list[str] = Field(default_factory=list, alias="preflightMismatched")
    """When it failed: the tensors whose engine copy differs from the trainer's."""
    last_update_seconds: float | None = Field(default=None, ge=0.0, alias="lastUpdateSeconds")
    """Wall time of the last weight update (pause to continue)."""
    wire_bytes: int | None = Field(default=None, ge=0, alias="wireBytes")
    """Bytes that crossed the wire in the last weight update."""
    last_update_fallback: str | None = Field(default=None, alias="lastUpdateFallback", max_length=32)
    """The transport that delivered the last update because the chosen one failed (p2p falls back to
    broadcast); unset when the chosen transport delivered it."""
    update_fallbacks: int | None = Field(default=None, ge=0, alias="updateFallbacks")
    """Updates delivered by a fallback transport since the driver started."""
    last_update_phases: dict[str, float] | None = Field(default=None, alias="lastUpdatePhases", max_length=32)
    """Seconds of the last weight update per phase (gather, convert, quantize, bucket, encode,
    transfer, patch, engine_load, commit, pause, resume, membership, other); they sum to
    lastUpdateSeconds (docs/weights.md, "Where an update's time goes")."""
    degraded: str | None = Field(default=None, max_length=4096)
    """Why the run trains nothing while it runs (e.g. steps in a row without a trained token); the
    operator sets the job's Degraded condition with it (reason NoTrainedTokens). Unset when healthy."""
    sandbox_aborts: int | None = Field(default=None, ge=0, alias="sandboxAborts")
    """Samples aborted because their sandbox failed, timed out or could not be claimed, since the driver
    started (spec.agent.sandbox; docs/sandbox.md)."""
    done: bool = False
    """True once the driver finished all steps (the job succeeds)."""
    error: str | None = Field(default=None, max_length=4096)
    """A fatal error of the driver (the job fails with it)."""
    reason: str | None = Field(default=None, max_length=64, pattern=r"^[A-Z][A-Za-z]*$")
    """CamelCase reason of `error`, shown as the Failed condition's reason (`DriverStartFailed`,
    `TrainerStartFailed`); unset reads `DriverError`."""


def progress_config_map_name(job: str) -> str:
    """Name of the ConfigMap the driver of RLJob `job` patches with its progress."""
    return f"{job}-progress"


def rank_key(rank: int) -> str:
    """The data key of trainer rank `rank`'s document (a start-up failure) in the progress ConfigMap."""
    return f"{RANK_KEY_PREFIX}{rank}.json"


def progress_patch(report: ProgressReport, key: str = PROGRESS_KEY) -> dict[str, dict[str, str]]:
    """The JSON merge patch body that replaces the document under `key` in the progress ConfigMap
    (other keys are left alone, so the driver and the ranks never overwrite each other)."""
    return {"data": {key: report.model_dump_json(by_alias=True, exclude_none=True)}}
