"""The driver's steps of both loops: start (resume, SFT warm start, first update), collect a batch, evaluate.

Why it exists: loop.py and fully_async.py should read like the five-line loop of §1; the lines that
touch the engines (rollout) are here, the lines that touch the policy are the Trainer protocol's
(lockstep.trainer.protocol). Both loops start and evaluate with the same functions.

Who calls it: lockstep.driver.sync and lockstep.driver.fully_async.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from lockstep.driver.preemption import until_preempted
from lockstep.driver.settings import Resume
from lockstep.rollout.group_signal import group_signal_metrics, groups_to_generate, keep_groups, select_groups
from lockstep.rollout.terminal import episode_metrics
from lockstep.trainer.state import DriverState
from lockstep.types import Group, Sample

if TYPE_CHECKING:
    from lockstep.driver.components import Components

EVAL_GROUP_BASE = 1_000_000_000
"""Group indices of eval samples start here (they never mix with training groups)."""


@dataclass(slots=True)
class EvalOutcome:
    """What an evaluation returns."""

    metrics: dict[str, float]
    """Scores (e.g. {"reward_mean": 0.4}); logged as kind "eval"."""
    versions_seen: set[int] = field(default_factory=set)
    """Weight versions the engines reported on the evaluation's tokens; proves which weights were scored."""


def start(c: Components) -> DriverState:
    """Before step 1 (both loops): resume, the SFT warm start once, then the first weight update."""
    state = c.trainer.load_latest() if c.resume is not Resume.NEVER else None
    if state is None and c.resume is Resume.REQUIRED:
        raise FileNotFoundError(f"--resume: no checkpoint in {c.trainer.where()}; run without --resume")
    # rows an earlier run wrote after this run's starting point are superseded (metrics.jsonl keeps them,
    # read_jsonl and the plots do not count them twice)
    c.metrics.resumed(state.step if state is not None else -1)
    state = state or DriverState()
    eval_interval = c.settings.schedule.eval_interval
    if not state.sft_done and c.settings.trainer.sft_steps > 0:
        if eval_interval:
            c.metrics.log("eval_init", 0, evaluate_at(c, state))  # reward before any training
        for k, m in enumerate(c.trainer.warm_start()):
            c.metrics.log("sft", k + 1, m)
        state.sft_done = True
        # A driver restarted before the first RL checkpoint resumes here instead of warm-starting the
        # trainer's (already warm-started) weights a second time.
        c.trainer.save(state)
    state.sft_done = True
    # Engines == trainer before step 1: the trainer's loaded weights go out through its own export path.
    updated = c.trainer.first_update(state.version)
    c.metrics.log("update_weights", state.step, updated)
    c.progress.init(updated, c.run_dir, state.step)
    for client in c.clients:  # a cluster's router serves once an engine holds this version (its gate)
        c.runner.run(client.wait_ready(timeout_s=c.engine_ready_timeout_s))
    if eval_interval and state.step == 0:
        c.metrics.log("eval", 0, evaluate_at(c, state))
    return state


def evaluate_at(c: Components, state: DriverState) -> dict[str, float]:
    """Evaluate on the components' event loop; the scores tagged with the version evaluated."""
    return {**c.runner.run(evaluate(c)).metrics, "weight_version": float(state.version)}


def collect_batch(c: Components, state: DriverState) -> tuple[list[Group], dict[str, float]]:
    """Generate and score `batch_groups` complete groups from the next prompts; advances the data position.

    With dynamic sampling (settings.max_groups_per_step) groups without a reward spread are dropped
    and more are generated, within the cap (lockstep.rollout.group_signal). Returns the groups to
    train on and the rollout's metrics: groups generated and dropped, and reward_mean over every
    generated sample (it replaces the trainer's mean of the trained groups, logged as
    trained_reward_mean), so the logged reward stays the policy's sampled reward. Raises Preempted when
    SIGTERM arrives meanwhile (the caller restores the data position).
    """
    s = c.settings.schedule
    cap = c.settings.max_groups_per_step
    generated = c.runner.run(until_preempted(_generate_groups(c, state, s.batch_groups), c.preemption))
    if cap is None:
        return generated, episode_metrics([x for g in generated for x in g.samples])
    while n := groups_to_generate(len(keep_groups(generated)), len(generated), s.batch_groups, cap):
        generated += c.runner.run(until_preempted(_generate_groups(c, state, n), c.preemption))
    groups = select_groups(generated, s.batch_groups)
    dropped = len(generated) - len(keep_groups(generated))
    rewards = [r for g in generated for r in g.rewards]
    trained = [r for g in groups for r in g.rewards]
    return groups, {
        # The policy's sampled reward is over every generated sample, dropped groups included; the
        # trained groups' mean is biased by the filter (no all-wrong groups early, no all-right late).
        "reward_mean": sum(rewards) / max(len(rewards), 1),
        "trained_reward_mean": sum(trained) / max(len(trained), 1),
        "groups_generated": float(len(generated)),
        "groups_dropped": float(dropped),
        **{f"generated_{k}": v for k, v in group_signal_metrics([g.rewards for g in generated]).items()},
        **episode_metrics([x for g in generated for x in g.samples]),
    }


async def _generate_groups(c: Components, state: DriverState, n: int) -> list[Group]:
    """`n` groups of the next train prompts, generated concurrently; advances the data position."""
    jobs = []
    for _ in range(n):
        item = c.task.item(state.prompts_consumed, "train")
        jobs.append(
            c.rollout.generate_group(
                state.next_group_index,
                item.messages,
                c.settings.schedule.samples_per_prompt,
                {**c.item_metadata(item), "prompt_position": state.prompts_consumed},
            )
        )
        state.prompts_consumed += 1
        state.next_group_index += 1
    return list(await asyncio.gather(*jobs))


async def evaluate(c: Components) -> EvalOutcome:
    """Mean reward on the task's eval split, one sample per item at the eval temperature (both loops)."""
    sampling = c.rollout.ctx.sampling.model_copy(update={"temperature": c.settings.eval_temperature})
    ctx = replace(c.rollout.ctx, sampling=sampling)
    agent_ctx = c.rollout.agent_ctx
    if agent_ctx is not None:  # an agent samples through its own context (the terminal agent: its sessions)
        agent_ctx = replace(agent_ctx, sampling=sampling)
        generate = c.rollout.plugins.generate
        agent_ctx.generate = lambda s: generate(ctx, s)
    # The task's reward alone: evaluation never asks a teacher (OPD scores training samples only).
    rollout = replace(c.rollout, ctx=ctx, agent_ctx=agent_ctx, scorer=None)
    samples = []
    for i in range(c.task.eval_size):
        item = c.task.item(i, "eval")
        samples.append(
            Sample(EVAL_GROUP_BASE + i, 0, rollout.render(item.messages), metadata=c.item_metadata(item))
        )
    done = await asyncio.gather(*(rollout.run_sample(s) for s in samples))
    rewards = [s.reward if s.reward is not None else 0.0 for s in done]
    seen = {v for s in done for v in s.token_versions if v is not None}
    return EvalOutcome(
        {"reward_mean": sum(rewards) / max(len(rewards), 1), "samples": float(len(done))}, seen
    )
