"""Which LoRA adapters a standalone pool's engines must lose: those of jobs that were deleted or ended.

Why: several RLJobs load their adapter versions (`<adapter>-v<n>`) on one user-owned pool
(rollout.poolRef, docs/lora.md). A job's trainer unloads them when it closes, but a trainer killed
first (SIGKILL, OOM, a lost node, a forced delete) leaves them loaded on engines that outlive the job,
until the pool restarts. So the pool remembers the adapter names of the jobs that used it (its
annotation rl.lockstep.dev/adapters) and, once no live job uses a remembered name any more (the job is
gone, Succeeded or Failed), the operator unloads that name's versions from every engine
(reconcile.adapter_gc) and forgets it. A name still used by a job that has not ended (the same job, or
one created again under the name, which sweeps what its predecessor left itself) is never unloaded.

Who calls it: lockstep_operator.reconcile.adapter_gc. Pure.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lockstep.api.rljob import Phase

ENDED = (Phase.SUCCEEDED, Phase.FAILED)


def adapter_of(job: Mapping[str, Any], pool: str) -> str | None:
    """The adapter name RLJob `job` (a raw object) loads on standalone pool `pool`, or None when it does
    not sample on that pool or trains no adapter: model.lora.adapterName, else the job's name (as
    policy.pool_ref.adapter_name, read from the raw object: no validation in a cleanup path)."""
    spec = job.get("spec") or {}
    ref = (spec.get("rollout") or {}).get("poolRef") or {}
    lora = (spec.get("model") or {}).get("lora")
    if ref.get("name") != pool or not isinstance(lora, Mapping):
        return None
    return str(lora.get("adapterName") or job["metadata"]["name"])


def recorded(value: str | None) -> set[str]:
    """The names in the pool's annotation (an unreadable value reads as none)."""
    try:
        names = json.loads(value) if value else []
    except ValueError:
        return set()
    return {str(n) for n in names} if isinstance(names, list) else set()


def encode(names: Iterable[str]) -> str:
    return json.dumps(sorted(set(names)))


@dataclass(frozen=True, slots=True)
class AdapterPlan:
    record: set[str]
    """What the pool remembers after this pass: the names before, plus every live job's."""
    stale: set[str]
    """Names no job that has not ended uses any more: their versions leave every engine."""


def plan(before: set[str], jobs: Iterable[Mapping[str, Any]], pool: str) -> AdapterPlan:
    """The pass's plan from the names remembered `before` and the namespace's RLJobs (raw objects)."""
    live: set[str] = set()
    ended: set[str] = set()
    for job in jobs:
        name = adapter_of(job, pool)
        if name is None:
            continue
        deleting = bool(job["metadata"].get("deletionTimestamp"))
        if deleting or (job.get("status") or {}).get("phase") in ENDED:
            ended.add(name)
        else:
            live.add(name)
    record = before | live | ended
    return AdapterPlan(record=record, stale=record - live)
