"""The WeightTransport protocol and the engine set a weight update reaches.

Why it exists: the trainer must not care whether weights travel by broadcast, CUDA IPC, a disk delta
or P2P writes (§7.2); it hands over HF-named tensors and a version and gets a report it can log.
A pool's engines change while a job runs (a replaced pod, a scale-up) and a new engine starts from the
base checkpoint, so before every update `update_members` asks the membership for the engines of the
moment and the transport follows them itself (`follow`): each transport module says what a change
means for it. docs/weights.md tells the whole story.

Who calls it: lockstep.trainer.local (every update), lockstep.weights.preflight, the transports.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from lockstep.serving.membership import EngineMembers, probe_health
from lockstep.weights import phases
from lockstep.weights.phases import metric_name

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TransferReport:
    """What one weight update did, for metrics and logs."""

    version: int
    """The weight version the engines hold after the update."""
    transport: str
    """Transport name: broadcast | cuda-ipc | disk-delta | p2p | from-disk | from-tensor."""
    tensors: int = 0
    """Number of tensors delivered."""
    payload_bytes: int = 0
    """Bytes of tensor data delivered (what the engines hold)."""
    wire_bytes: int = 0
    """Bytes that actually crossed the wire or hit the shared disk (update_weights_wire_bytes)."""
    seconds: float = 0.0
    """Wall time of the update, pause to continue."""
    extra: dict[str, float] = field(default_factory=dict)
    """Transport-specific metrics (e.g. update_weights_density for disk-delta)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase of the update (lockstep.weights.phases.PHASES); they sum to `seconds`."""

    def metrics(self) -> dict[str, float]:
        """The step metrics of this update: version, seconds, `extra` and one per phase."""
        return {
            "weight_version": float(self.version),
            "update_weights_s": self.seconds,
            **self.extra,
            **{metric_name(p): s for p, s in self.phases.items()},
        }


class WeightTransport(Protocol):
    """Moves a complete policy version to every engine, or raises; never half-succeeds silently."""

    name: str

    def follow(self, urls: list[str]) -> None:
        """Make the next update reach exactly these engines (sorted base URLs), or raise
        MembershipChanged naming the fix when this transport cannot reach a new set."""
        ...

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> TransferReport:
        """Deliver every (HF name, full tensor) pair to every engine and set their weight version.

        Tensors come in HF/SGLang names and layout (already gathered and converted). Raises on any
        failed write; the engines' weight version changes only when all tensors arrived.
        """
        ...

    def close(self) -> None:
        """Release groups, registered buffers and files."""
        ...


class MembershipChanged(RuntimeError):
    """The engines changed and this transport cannot follow; the message names them and the fix."""


def refuse_change(transport: str, bound: Sequence[str], urls: Sequence[str], fix: str) -> None:
    """For a transport bound to its engines at start (p2p, cuda-ipc): raise when `urls` differ."""
    if sorted(urls) == sorted(bound):
        return
    joined = sorted(set(urls) - set(bound))
    left = sorted(set(bound) - set(urls))
    raise MembershipChanged(
        f"spec.weightSync.transport {transport}: the engines changed since the trainer started "
        f"(joined: {', '.join(joined) or '-'}; left: {', '.join(left) or '-'}) and this transport cannot "
        f"reach a new set; {fix}"
    )


@dataclass(slots=True)
class EngineSet:
    """The engines a weight update reaches: those `members` lists now that were reached before, and
    new ones once they answer GET /health (a pod is listed minutes before its server has loaded)."""

    members: EngineMembers
    """Where the engines of the moment come from (lockstep.serving.membership)."""
    reached: list[str]
    """The engines the last update reached (at start: those known ready)."""
    healthy: Callable[[str], bool] = probe_health
    """url -> whether a newly listed engine serves yet."""

    def targets(self, version: int) -> list[str]:
        """The engines to update to `version` now; raises naming the membership source when none serves."""
        before = set(self.reached)
        urls = []
        for url in self.members.urls():
            if url in before or self.healthy(url):
                urls.append(url)
            else:
                log.info("engine %s is listed but does not serve yet; a later update reaches it", url)
        if not urls:
            raise RuntimeError(
                f"weight update to version {version}: no engine serves in {self.members.describe()}; "
                "check the rollout pool's engine pods"
            )
        joined, left = sorted(set(urls) - before), sorted(before - set(urls))
        if joined or left:
            log.info(
                "engines changed before version %d: joined %s, left %s", version, joined or "-", left or "-"
            )
        return urls


def update_members(
    transport: WeightTransport,
    engines: EngineSet,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    version: int,
) -> TransferReport:
    """One weight update to every engine of the moment: the transport follows them, then updates.

    An engine that left is dropped; one that was reached before and no longer answers fails the
    update, named in the error. The report's `update_weights_engines` counts the engines reached.
    """
    with phases.measure() as timer:
        with phases.phase("membership"):
            urls = engines.targets(version)
            transport.follow(urls)
        report = transport.update_weights(named_tensors, version)  # each transport times its gather
    timer.stamp(report)
    engines.reached = urls
    report.extra["update_weights_engines"] = float(len(urls))
    # Every step updates: the engine list is logged at debug (membership changes are logged above).
    log.debug("version %d sent (%s) to %d engines: %s", version, transport.name, len(urls), ", ".join(urls))
    return report
