"""In-process weight transport: the engines live in the trainer's process, so tensors are handed over.

Why it exists: on one machine `lockstep run` embeds its reference engines in its own process. From-disk
(a full safetensors checkpoint per version, reloaded by every engine) works for any engine, but for
these it writes and reads the whole model through the file system every step (8 GB per step at the
Qwen3-4B shape of examples/h100.yaml). Here each engine's `Handoff` copies the trainer's tensors into
its weights directly, with the guarantees of every transport: the version is set only after every
tensor arrived, a tensor the engine does not hold (name, shape) fails the whole update before any
weight changes, generation is paused around the load, and the pre-flight check runs on it like on
any other. `spec.weightSync.transport: auto` picks it when every engine is embedded
(lockstep.weights.factory); external engines keep from-disk. docs/weights.md ("In-process handoff")
has the figures.

Who calls it: lockstep.weights.factory; the handoffs come from lockstep.engine.handoff (built by the
driver, which alone may import the engine).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from lockstep.weights import phases
from lockstep.weights.transport import TransferReport, refuse_change

if TYPE_CHECKING:
    import torch


class Handoff(Protocol):
    """One engine of this process that loads tensors handed to it (lockstep.engine.handoff.EngineHandoff)."""

    url: str

    def load(
        self, named: Sequence[tuple[str, torch.Tensor]], version: int, *, pause_mode: str | None = "retract"
    ) -> int:
        """Install every tensor as `version`, all or nothing; returns how many; raises naming the problem."""
        ...


class InProcessTransport:
    """WeightTransport into engines embedded in this process: one copy, no disk, no wire."""

    name = "in-process"

    def __init__(
        self,
        handoffs: Sequence[Handoff],
        *,
        pause_mode: str | None = "retract",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not handoffs:
            raise ValueError("handoffs is empty: the in-process transport needs at least one embedded engine")
        self.handoffs = {h.url: h for h in handoffs}
        """The embedded engines, by URL."""
        self.targets = list(self.handoffs.values())
        """The engines the next update reaches (`follow` sets them)."""
        self.pause_mode = pause_mode
        """How generation pauses around each engine's load (spec.weightSync.pauseMode)."""
        self.clock = clock

    def follow(self, urls: list[str]) -> None:
        """The embedded engines are fixed for the run; any other set is refused, naming the fix."""
        fix = "the in-process transport reaches the engines this process embeds; use from-disk for others"
        refuse_change(self.name, list(self.handoffs), urls, fix)
        self.targets = [self.handoffs[u] for u in sorted(urls)]

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> TransferReport:
        with phases.measure(self.clock) as timer:
            tensors = list(phases.timed(named_tensors, "gather"))
            if not tensors:
                raise ValueError(f"version {version}: no tensors to hand over; the trainer exported nothing")
            for handoff in self.targets:
                handoff.load(tensors, version, pause_mode=self.pause_mode)
        payload = sum(t.numel() * t.element_size() for _, t in tensors)
        report = TransferReport(
            version=version,
            transport=self.name,
            tensors=len(tensors),
            payload_bytes=payload,
            wire_bytes=0,  # memory to memory inside one process
            extra={"update_weights_wire_bytes": 0.0},
        )
        return timer.stamp(report)

    def close(self) -> None:
        return None
