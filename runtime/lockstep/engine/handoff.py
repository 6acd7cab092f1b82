"""In-process weight handoff: the trainer of this process loads its tensors into an engine of this process.

Why it exists: `lockstep run` embeds reference engines in the driver's process (lockstep.driver.engines),
beside the trainer. Writing every version as a full checkpoint and reloading it from disk (what an
external engine needs) moves each byte three times through the file system; here the engine can take
the trainer's tensors directly: one copy, memory to memory. The handoff runs the same transaction as
the engine's HTTP weight routes (lockstep.engine.server): the version is checked before anything moves,
then under the step lock every tensor is checked against the model and staged (a wrong name, shape or
dtype fails the whole update with the weights untouched), copied into the live parameters on the
engine's worker thread, the prefix cache flushed, and only then the version set. Generation is paused
around it like every other transport pauses it (docs/weights.md, "In-process handoff").

Who calls it: lockstep.driver.engines builds one per embedded engine; lockstep.weights.inprocess (the
transport) calls `load` from the trainer's thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lockstep.engine.core import EngineInputError, ReferenceEngine
from lockstep.weights import phases

if TYPE_CHECKING:
    import torch


class HandoffRefused(RuntimeError):
    """The engine refused the update before its swap: its weights and version are the old ones."""


class EngineHandoff:
    """Loads tensors into one engine served on `loop` (another thread of this process)."""

    def __init__(self, engine: ReferenceEngine, loop: asyncio.AbstractEventLoop, url: str) -> None:
        self.engine = engine
        """The embedded engine."""
        self.loop = loop
        """The event loop its server and scheduler run on."""
        self.url = url
        """Its HTTP address (how the rest of the run names it)."""

    def load(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        version: int,
        *,
        pause_mode: str | None = "retract",
        timeout_s: float = 600.0,
    ) -> int:
        """Install `named` (HF names, full tensors) as `version`; returns the tensor count.

        The tensors are read, not kept: the caller may change them once this returns. Raises
        HandoffRefused naming the problem when nothing was changed.
        """
        timer = phases.current()  # the coroutine runs on the engine's loop; charge this update's timer
        future = asyncio.run_coroutine_threadsafe(self._install(named, version, pause_mode, timer), self.loop)
        return future.result(timeout_s)

    async def _install(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        version: int,
        pause_mode: str | None,
        timer: phases.PhaseTimer | None,
    ) -> int:
        engine = self.engine
        try:
            v = engine.check_version(version, new_weights=True)
        except EngineInputError as e:
            raise HandoffRefused(f"engine {self.url}: {e}") from e
        if pause_mode is not None:
            with phases.charged(timer, "pause"):
                await engine.pause(pause_mode)  # type: ignore[arg-type]  # checked by the engine
        try:
            async with engine.exclusive():
                with phases.charged(timer, "engine_load"):
                    try:  # owned: the trainer waits for this call, its tensors do not change meanwhile
                        staged = await engine.run_in_worker(
                            lambda: engine.stage_weights(named, cast=True, owned=True)
                        )
                    except (KeyError, ValueError, TypeError) as e:
                        raise HandoffRefused(
                            f"engine {self.url} refused version {version}: {e}; its weights and version "
                            f"{engine.weight_version} are unchanged"
                        ) from e
                    n: int = await engine.run_in_worker(engine.commit_weights, staged)
                with phases.charged(timer, "commit"):
                    engine.flush_cache()
                    assert v is not None
                    engine.set_weight_version(v, new_weights=True)
        finally:
            if pause_mode is not None:
                with phases.charged(timer, "resume"):
                    await engine.resume()
        return n
