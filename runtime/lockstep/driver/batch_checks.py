"""No silent success: the checks every batch passes before the trainer sees it, in both loops.

Why it exists: a job whose agent raises on every trajectory (or whose family has no chat boundaries,
or whose sandbox fails every sample: those samples are aborted one by one, the sandbox's error
recorded) used to print "done", exit 0 and train nothing: each failed
sample just trained zero tokens. So, per step:

- a batch in which every trajectory failed (status failed or aborted) stops the run with
  RolloutFailed naming the last error: `lockstep run` exits 6, and in a cluster the driver reports it
  and the RLJob ends `Failed` with reason `RolloutFailed`;
- a reward the loss cannot use (non-finite, or beyond lockstep.trainer.wire.REWARD_LIMIT) stops it
  with NonFiniteLoss naming the sample (exit 4, the last good checkpoint intact), before the trainer
  (in this process or a trainer group's ranks) changes any state;
- ZERO_TOKEN_STEPS steps in a row whose batch holds no trainable token (some samples succeeded, but
  none carries a token with loss_mask 1) set the job's `Degraded` condition with the reason, through
  the progress channel; the first step that trains a token clears it.

Each step's data positions are recorded too (`record_data`), so which prompts trained is auditable.

Who calls it: lockstep.driver.sync (run_sync) and lockstep.driver.fully_async.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lockstep.progress import DriverProgress
from lockstep.rollout.async_worker import RolloutFailed
from lockstep.tasks.shell.rows import SANDBOX_KEY
from lockstep.trainer.protocol import NonFiniteLoss
from lockstep.trainer.wire import REWARD_LIMIT
from lockstep.types import Group, Sample, SampleStatus

if TYPE_CHECKING:
    from lockstep.driver.components import Components

log = logging.getLogger(__name__)

ZERO_TOKEN_STEPS = 3
"""Consecutive steps without a trained token before the job is marked Degraded."""
_UNUSABLE = (SampleStatus.FAILED, SampleStatus.ABORTED)


def _error_of(s: Sample) -> str:
    error = s.metadata.get("error")
    if error:
        return str(error)
    sandbox = s.metadata.get(SANDBOX_KEY)
    if isinstance(sandbox, Mapping) and sandbox.get("aborted"):  # the sample's sandbox failed
        return f"sandbox {sandbox['aborted']}: {sandbox.get('error', '')}"
    return "aborted" if s.status is SampleStatus.ABORTED else "failed without a recorded error"


def check_rewards(groups: list[Group]) -> None:
    """Raise NonFiniteLoss naming the first sample whose reward the loss cannot use."""
    for g in groups:
        for s in g.samples:
            r = s.reward
            if r is not None and not (math.isfinite(r) and abs(r) <= REWARD_LIMIT):
                raise NonFiniteLoss(
                    f"sample {s.group_index}/{s.index}: reward {r!r} would make a non-finite loss (rewards "
                    f"must be finite numbers within +-{REWARD_LIMIT:g}); fix the reward function, nothing "
                    "was trained on it"
                )


def trained_tokens(groups: list[Group]) -> int:
    """Tokens that reach the loss: loss_mask 1 on samples that did not fail."""
    return sum(sum(s.loss_mask) for g in groups for s in g.samples if s.status not in _UNUSABLE)


@dataclass(slots=True)
class BatchWatch:
    """Per-run state of the checks (one per loop)."""

    progress: DriverProgress
    """Where Degraded is reported (the operator's progress channel; nowhere for a local run)."""
    zero_token_steps: int = 0
    """Steps in a row whose batch trained no token."""
    degraded: str | None = None
    """The reason reported as Degraded, None while healthy."""

    def check(self, step: int, groups: list[Group]) -> dict[str, float]:
        """Check the batch of optimizer step `step` before it trains (raises RolloutFailed or
        NonFiniteLoss); returns metrics (trained_tokens, failed_frac)."""
        samples = [s for g in groups for s in g.samples]
        failed = [s for s in samples if s.status in _UNUSABLE]
        if samples and len(failed) == len(samples):
            raise RolloutFailed(
                f"step {step}: all {len(samples)} trajectories failed (last error: {_error_of(failed[-1])}); "
                "fix the agent, generate or reward function, or the engine request it sends"
            )
        check_rewards(groups)
        tokens = trained_tokens(groups)
        self._track(step, tokens, failed)
        return {"trained_tokens": float(tokens), "failed_frac": len(failed) / max(len(samples), 1)}

    def _track(self, step: int, tokens: int, failed: list[Sample]) -> None:
        if tokens > 0:
            self.zero_token_steps = 0
            if self.degraded is not None:
                log.info("step %d trained %d tokens: no longer degraded", step, tokens)
                self.degraded = None
                self.progress.degraded(None)
            return
        self.zero_token_steps += 1
        if self.zero_token_steps < ZERO_TOKEN_STEPS or self.degraded is not None:
            return
        why = f"; last error: {_error_of(failed[-1])}" if failed else ""
        self.degraded = (
            f"{self.zero_token_steps} steps in a row trained no token (no sample has a token with "
            f"loss_mask 1{why}): check the agent and the model family's chat boundaries"
        )
        log.warning("degraded: %s", self.degraded)
        self.progress.degraded(self.degraded)


def record_data(c: Components, step: int, groups: list[Group]) -> None:
    """metrics.jsonl row `{"kind": "data", "step": step, "positions": [...], "groups": [...]}`: the data
    positions and group indices `step` trains on (data lineage; the resume tests count prompts with it)."""
    positions = [g.samples[0].metadata.get("prompt_position", -1) if g.samples else -1 for g in groups]
    c.metrics.record("data", step, {"positions": positions, "groups": [g.index for g in groups]})
