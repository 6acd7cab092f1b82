"""The progress channel: what the driver reports, and how the operator reads it.

Why it exists: pods get no broad RBAC. The driver (which owns the loop and the buffer) may only
get/patch one ConfigMap, `<job>-progress`; it writes one JSON document under the key `progress.json`
after each step (and after the pre-flight check). The operator reads it and folds it into the status
of the RLJob (step, version, reward, staleness, queue size), the RolloutPool (per-engine versions:
this is how "an engine holds the current weight version" is observed) and the WeightChannel
(preflight result, last update). This module is the contract of that document.

Who calls it: the reconciles (`read_progress`); the e2e tests and the driver write it, e.g.
`kubectl patch configmap <job>-progress -p '{"data":{"progress.json":"{\"step\":3,...}"}}'`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PROGRESS_KEY = "progress.json"
"""The ConfigMap data key holding the document."""


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
    preflight: Literal["passed", "failed"] | None = None
    """Result of the weight-equality pre-flight check; None while it has not run."""
    preflight_mismatched: list[str] = Field(default_factory=list, alias="preflightMismatched")
    """When it failed: the tensors whose engine copy differs from the trainer's."""
    last_update_seconds: float | None = Field(default=None, ge=0.0, alias="lastUpdateSeconds")
    """Wall time of the last weight update (pause to continue)."""
    wire_bytes: int | None = Field(default=None, ge=0, alias="wireBytes")
    """Bytes that crossed the wire in the last weight update."""
    done: bool = False
    """True once the driver finished all steps (the job succeeds)."""
    error: str | None = Field(default=None, max_length=4096)
    """A fatal error of the driver (the job fails with it)."""


def read_progress(config_map: Mapping[str, Any] | None) -> tuple[ProgressReport | None, str | None]:
    """Parse the progress ConfigMap; (report, None), (None, None) when empty, (None, problem) when bad."""
    if not config_map:
        return None, None
    raw = (config_map.get("data") or {}).get(PROGRESS_KEY)
    if not raw:
        return None, None
    try:
        return ProgressReport.model_validate(json.loads(raw)), None
    except ValidationError as err:
        where = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()[:5])
        return None, f"{PROGRESS_KEY} in the progress ConfigMap is not a valid report: {where}"
    except ValueError as err:
        return None, f"{PROGRESS_KEY} in the progress ConfigMap is not JSON: {err}"
