"""When the trainer gang restarts, fails or rolls, and which rank pods go (pure; JobSet's model).

A torch.distributed world cannot lose one rank: the others hang in a collective. So the group lives
and restarts as a gang. The gang generation is status.restarts; every rank pod carries its generation.
- A Failed rank of the current generation restarts the gang while restarts < the limit (the count
  goes up first: the reconcile writes it before deleting anything, so a crash cannot lose it); at the
  limit the group fails with that rank's reason and every pod is deleted to free the GPUs.
- A rank whose pod-template hash differs from a fresh rendering (the spec changed) restarts the gang
  the same way without counting (`rolling`: condition UpToDate=False while it runs).
- Pods of older generations are deleted; the missing ranks start only once no old or terminating
  pod is left (the new world must not meet the old one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RankPod:
    """One rank pod as the TrainerGroup reconcile observed it."""

    name: str
    """Pod name."""
    generation: int
    """The gang generation it was created for (-1: unknown)."""
    current_template: bool
    """Its pod-template hash equals a fresh rendering of its rank."""
    terminating: bool
    """Deletion already requested."""
    failed: bool
    """Pod phase Failed."""
    why: str = ""
    """`rank R (pod P) failed: reason (exit N): message` for a failed pod."""


@dataclass(frozen=True, slots=True)
class GangDecision:
    """What the reconcile does this pass."""

    restarts: int
    """The gang generation after this pass (one more than before on a counted restart)."""
    failed: str | None
    """The Failed condition's message once the restart limit is exhausted (or was before)."""
    stopped: bool
    """No rank may run: suspended, the job ended, or the group failed."""
    rolling: bool
    """A spec change is restarting the gang (not counted against the limit)."""
    keep: tuple[str, ...]
    """Rank pods that stay."""
    delete: tuple[str, ...]
    """Rank pods to delete now (never one already terminating)."""
    start_missing: bool
    """Create the missing ranks of generation `restarts` (nothing old or terminating is left)."""


def gang_restart(
    pods: Sequence[RankPod], *, restarts: int, limit: int, stopped: bool, failed: str | None
) -> GangDecision:
    """Decide the pass for `pods` of a group at generation `restarts` with `limit` restarts allowed.

    `stopped`: the job is suspended or ended; `failed`: the group's Failed message from before.
    """
    stopped = stopped or failed is not None
    current = [p for p in pods if p.generation == restarts and p.current_template]
    stale = [p for p in pods if p.generation == restarts and not p.current_template]
    broken = [p for p in current if not p.terminating and p.failed]
    if broken and not stopped:
        if restarts < limit:
            restarts += 1
        else:
            failed, stopped = f"{broken[0].why}; gang restart limit {limit} reached", True
    rolling = bool(stale) and not stopped
    keep = [] if stopped or any(not p.terminating for p in stale) else current
    keep = [p for p in keep if p.generation == restarts and not p.terminating]
    delete = tuple(p.name for p in pods if p not in keep and not p.terminating)
    return GangDecision(
        restarts=restarts,
        failed=failed,
        stopped=stopped,
        rolling=rolling,
        keep=tuple(p.name for p in keep),
        delete=delete,
        start_missing=not stopped and len(keep) == len(pods),
    )
