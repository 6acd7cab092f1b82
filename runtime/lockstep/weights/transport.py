"""The WeightTransport protocol: what the driver calls to publish a new policy version.

Why it exists: the driver must not care whether weights travel by NCCL broadcast, CUDA IPC, a
disk delta or P2P writes (seed §7.2); it hands over the trainer's HF-named tensors and a version and
gets back a report it can log. Each transport module implements this protocol.

Who calls it: lockstep.driver (the loop) and lockstep.weights.preflight.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


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


class WeightTransport(Protocol):
    """Moves a complete policy version to every engine, or raises; never half-succeeds silently."""

    name: str

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> TransferReport:
        """Deliver every (HF name, full tensor) pair to every engine and set their weight version.

        Tensors come in HF/SGLang names and layout (already gathered and converted). Raises on any
        failed write; the engines' weight version changes only when all tensors arrived.
        """
        ...

    def close(self) -> None:
        """Release groups, registered buffers and files."""
        ...
