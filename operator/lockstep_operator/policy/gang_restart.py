"""When the trainer gang restarts, fails or rolls, and which rank pods go (pure; JobSet's model).

A torch.distributed world cannot lose one rank: the others hang in a collective, or a replacement
waits in the rendezvous for peers that left. So the group lives and restarts as a gang. The gang
generation is status.restarts; every rank pod carries its generation.
- A fault of the current generation restarts the gang while restarts < the limit (the count goes up
  first: the reconcile writes it before deleting anything, so a crash cannot lose it); at the limit
  the group fails with the first fault and every pod is deleted to free the GPUs. While the job runs
  (not stopped, the driver has not reported `done`), each of these is a fault:
  - a rank pod that Failed;
  - a rank pod that Succeeded: a rank exits 0 only after the driver's shutdown, which comes after
    `done`; before that its group was broken (a peer's pod deleted or drained);
  - a rank whose pod is gone while another rank's pod of the generation is still there, once every
    rank of the generation was created (`complete`): the pod was deleted, and a replacement alone
    would wait in the rendezvous for a world that is gone.
  Once the driver reported `done`, ranks exit 0 on its shutdown: nothing then is a fault.
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
    rank: int
    """Its rank label (-1: unknown)."""
    generation: int
    """The gang generation it was created for (-1: unknown)."""
    current_template: bool
    """Its pod-template hash equals a fresh rendering of its rank."""
    terminating: bool
    """Deletion already requested."""
    failed: bool = False
    """Pod phase Failed."""
    succeeded: bool = False
    """Pod phase Succeeded (every container exited 0)."""
    why: str = ""
    """For a pod that ended: `rank R (pod P) failed: reason (exit N): message`, or `rank R (pod P)
    exited 0 before the job completed`."""


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
    faults: tuple[str, ...] = ()
    """Why the gang restarts or fails this pass (one line per broken rank; empty otherwise)."""


def gang_restart(
    pods: Sequence[RankPod],
    *,
    ranks: int,
    restarts: int,
    limit: int,
    stopped: bool,
    failed: str | None,
    done: bool,
    complete: bool,
) -> GangDecision:
    """Decide the pass for `pods` of a group of `ranks` rank pods at generation `restarts` with
    `limit` restarts allowed.

    `stopped`: the job is suspended or ended; `failed`: the group's Failed message from before;
    `done`: the driver reported every step done (ranks exiting now is the job's end); `complete`:
    every rank pod of generation `restarts` was created (a missing one since was deleted).
    """
    stopped = stopped or failed is not None
    current = [p for p in pods if p.generation == restarts and p.current_template]
    stale = [p for p in pods if p.generation == restarts and not p.current_template]
    faults = () if stopped or done else gang_faults(pods, ranks=ranks, restarts=restarts, complete=complete)
    if faults:
        if restarts < limit:
            restarts += 1
        else:
            failed, stopped = f"{faults[0]}; gang restart limit {limit} reached", True
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
        faults=faults,
    )


def gang_faults(pods: Sequence[RankPod], *, ranks: int, restarts: int, complete: bool) -> tuple[str, ...]:
    """What broke the running gang of generation `restarts`, the likely cause first: ranks whose pod
    was deleted (once the generation was `complete`, while another rank's pod is still there and not
    terminating: a roll or a stop deletes every rank), then Failed ranks, then ranks that exited 0."""
    mine = [p for p in pods if p.generation == restarts]
    live = [p for p in mine if p.current_template and not p.terminating]
    present = {p.rank for p in mine}
    deleted = [f"rank {r}'s pod was deleted" for r in range(ranks) if r not in present]
    failed = [p.why for p in live if p.failed]
    exited = [p.why for p in live if p.succeeded and not p.failed]
    return (*(deleted if complete and live else []), *failed, *exited)
