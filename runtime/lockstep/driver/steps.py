"""The driver's steps of the loop: collect a batch of complete groups, evaluate.

Why it exists: loop.py should read like the seed's five-line loop; the lines that touch the engines
(rollout) are here, the lines that touch the policy are the Trainer protocol's (lockstep.trainer).

Who calls it: lockstep.driver.loop and lockstep.driver.fully_async.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from lockstep.rollout.generate import Rollout
from lockstep.types import Group, Sample

if TYPE_CHECKING:
    from lockstep.driver.components import Components
    from lockstep.trainer.state import DriverState

log = logging.getLogger(__name__)

EVAL_GROUP_BASE = 1_000_000_000
"""Group indices of eval samples start here (they never mix with training groups)."""


def collect_batch(c: Components, state: DriverState) -> list[Group]:
    """Generate and score `batch_groups` complete groups from the next prompts; advances the data position."""
    s = c.settings
    jobs = []
    for _ in range(s.batch_groups):
        item = c.task.item(state.prompts_consumed, "train")
        jobs.append(
            c.rollout.generate_group(
                state.next_group_index, item.messages, s.samples_per_prompt, c.item_metadata(item)
            )
        )
        state.prompts_consumed += 1
        state.next_group_index += 1

    async def gather() -> list[Group]:
        return list(await asyncio.gather(*jobs))

    return c.runner.run(gather())


def evaluate(c: Components, first_group: int = EVAL_GROUP_BASE) -> dict[str, float]:
    """Mean reward on the task's eval split, one sample per item at the eval temperature."""
    sampling = c.rollout.ctx.sampling.model_copy(update={"temperature": c.settings.eval_temperature})
    rollout: Rollout = replace(c.rollout, ctx=replace(c.rollout.ctx, sampling=sampling))
    samples = []
    for i in range(c.task.eval_size):
        item = c.task.item(i, "eval")
        samples.append(
            Sample(first_group + i, 0, rollout.render(item.messages), metadata=c.item_metadata(item))
        )

    async def run() -> list[Sample]:
        return list(await asyncio.gather(*(rollout.run_sample(s) for s in samples)))

    done = c.runner.run(run())
    rewards = [s.reward if s.reward is not None else 0.0 for s in done]
    return {"reward_mean": sum(rewards) / max(len(rewards), 1), "samples": float(len(rewards))}
