"""The loop's building blocks: collect a batch, train on it, push weights, evaluate, SFT warm start.

Why it exists: loop.py should read like the seed's five-line loop; each line is one function here.
Driver-side steps (collect_batch, evaluate) take the run's Components; trainer-side steps
(train_on_groups, push_weights, first_push, sft_warm_start) take TrainerParts, because in a cluster
they run on the trainer ranks (lockstep.driver.trainer_server), not in the driver.

Who calls it: lockstep.driver.loop and lockstep.driver.fully_async (driver side);
lockstep.driver.trainer.LocalTrainer (trainer side, in the driver or on rank 0 of a trainer group).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

from lockstep.rollout.generate import Rollout
from lockstep.train.common.losses import policy_loss, sft_loss
from lockstep.train.common.mismatch import mismatch_weights
from lockstep.train.common.packing import pack_groups, pack_sft, response_view
from lockstep.train.common.r3 import collate_routed_experts
from lockstep.types import Group, Sample, SampleStatus

if TYPE_CHECKING:
    from lockstep.driver.components import Components
    from lockstep.driver.state import DriverState
    from lockstep.driver.trainer import TrainerParts
    from lockstep.weights.preflight import PreflightResult

log = logging.getLogger(__name__)

EVAL_GROUP_BASE = 1_000_000_000
"""Group indices of eval samples start here (they never mix with training groups)."""
SFT_ITEM_BASE = 10_000_000
"""SFT warm-start items are drawn from this train-split offset, apart from the RL prompts."""


class NonFiniteLoss(RuntimeError):
    """The loss or gradient norm was NaN/inf; the step was not applied."""


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


def batch_metrics(groups: list[Group]) -> dict[str, float]:
    """Reward and length statistics of a batch (pure)."""
    samples = [s for g in groups for s in g.samples]
    rewards = [s.reward if s.reward is not None else 0.0 for s in samples]
    n = max(len(samples), 1)
    mean = sum(rewards) / n
    return {
        "reward_mean": mean,
        "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / n),
        "response_len_mean": sum(len(s.response_ids) for s in samples) / n,
        "truncated_frac": sum(s.status is SampleStatus.TRUNCATED for s in samples) / n,
        "failed_samples": float(
            sum(s.status in (SampleStatus.FAILED, SampleStatus.ABORTED) for s in samples)
        ),
        "solved_groups_frac": sum(all(r >= 1.0 for r in g.rewards) for g in groups) / max(len(groups), 1),
    }


def train_on_groups(c: TrainerParts, groups: list[Group]) -> dict[str, float]:
    """One RL optimizer step on complete groups; returns the step's metrics.

    Recomputes the trainer's logprobs of the exact rollout token IDs with the pre-update weights
    (train_old), measures the train-rollout mismatch, then trains with the configured loss.
    Raises NonFiniteLoss when the step could not be applied (weights unchanged).
    """
    batch = pack_groups(groups, c.loss.estimator, c.pad_id, c.settings.temperature)
    batch.routed_experts = collate_routed_experts(groups)  # R3: one payload per row (None without)
    t0 = c.clock()
    batch.old_logprobs = c.backend.compute_logprobs(batch)
    if c.loss.kl_coef > 0:
        batch.ref_logprobs = c.backend.compute_logprobs(batch, role="ref")
    _, mismatch = mismatch_weights(
        batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, c.loss.mismatch
    )
    t1 = c.clock()
    # A partial of a module-level function (not a closure) so rank 0 can send it to the other ranks.
    result = c.backend.train_step(batch, partial(policy_loss, config=c.loss))
    if result.skipped:
        raise NonFiniteLoss(
            f"non-finite loss ({result.loss}) or gradient norm ({result.grad_norm}); the step was not applied"
        )
    return {
        **batch_metrics(groups),
        **mismatch,
        **result.metrics,
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "train_tokens": float(result.tokens),
        "time_logprobs_s": t1 - t0,
        "time_train_s": c.clock() - t1,
    }


def push_weights(c: TrainerParts, version: int) -> dict[str, float]:
    """Publish the trainer's current weights to every engine as `version`."""
    report = c.transport.push(c.backend.export_weights(), version)
    if str(c.job.spec.trainer.offload) != "none":
        c.backend.offload()  # seed §7.1: wait for the next batch off the GPU; the next call brings it back
    return {"weight_version": float(report.version), "update_weights_s": report.seconds, **report.extra}


PREFLIGHT_FILE = "preflight.json"
"""Where in the run dir the pre-flight's PreflightResult (pydantic JSON) is written, passed or not."""


def first_push(c: TrainerParts, version: int) -> dict[str, float]:
    """The push before step 1: through the pre-flight check when spec.weightSync.checkWeightUpdateEqual."""
    if c.job.spec.weight_sync.check_weight_update_equal:
        return preflight_push(c, version)
    (c.run_dir / PREFLIGHT_FILE).unlink(missing_ok=True)  # a result of an earlier start is not this one's
    return push_weights(c, version)


class PreflightFailed(RuntimeError):
    """check-weight-update-equal found engines that do not hold the trainer's weights."""

    def __init__(self, message: str, result: PreflightResult | None = None) -> None:
        super().__init__(message)
        self.result = result
        """The full result (differing tensors), carried to the driver when the check ran elsewhere."""


def preflight_push(c: TrainerParts, version: int) -> dict[str, float]:
    """The first push through the pre-flight check (seed §7.2.5): randomize engines, push, compare.

    Raises PreflightFailed naming the differing tensors (or the logprob probe gap) before any step.
    """
    from lockstep.weights.preflight import LogprobProbe, check_weight_update_equal

    def trainer_logprobs(prompt: list[int], response: list[int]) -> list[float]:
        batch = pack_sft([(prompt, response)], c.pad_id)  # greedy probe: temperature 1 definition
        return response_view(batch, c.backend.compute_logprobs(batch), 0)

    probe_prompt = c.render(c.task.item(0, "train").messages)
    t0 = c.clock()
    result = check_weight_update_equal(
        list(c.engine_urls),
        c.transport,
        c.backend.export_weights,
        version=version,
        probe=LogprobProbe(
            probe_prompt,
            trainer_logprobs,
            tolerance=1e-3 if getattr(c.backend, "device_type", "cpu") == "cpu" else 0.05,
        ),
        seed=c.settings.seed,
    )
    (c.run_dir / PREFLIGHT_FILE).write_text(result.model_dump_json(indent=2) + "\n")
    log.info("pre-flight %s: %s", "passed" if result.passed else "FAILED", result.message)
    if not result.passed:
        raise PreflightFailed(f"spec.weightSync.checkWeightUpdateEqual: {result.message}", result)
    return {
        "weight_version": float(version),
        "update_weights_s": c.clock() - t0,
        "preflight_tensors": float(result.checked_tensors),
        "preflight_logprob_max_abs_diff": result.logprob_max_abs_diff or 0.0,
    }


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


def sft_warm_start(c: TrainerParts) -> Iterator[dict[str, float]]:
    """The SFT warm start: `sft_steps` steps of NLL on the task's reference answers (assistant tokens only).

    Uses the same backend and optimizer as RL; items come from a train-split offset (SFT_ITEM_BASE) so
    RL prompts are not the ones just imitated. Yields each step's metrics.
    """
    s = c.settings
    rows = s.batch_groups * s.samples_per_prompt
    eos = c.encode("<|eos|>")
    if s.sft_learning_rate is not None:
        c.backend.set_learning_rate(s.sft_learning_rate)
    for k in range(s.sft_steps):
        pairs = []
        for j in range(rows):
            item = c.task.item(SFT_ITEM_BASE + k * rows + j, "train")
            pairs.append((c.render(item.messages), c.encode(item.answer) + eos))
        result = c.backend.train_step(pack_sft(pairs, c.pad_id), sft_loss)
        if result.skipped:
            raise NonFiniteLoss(f"SFT warm start step {k}: non-finite loss {result.loss}")
        yield {"loss": result.loss, "grad_norm": result.grad_norm, **result.metrics}
    c.backend.set_learning_rate(s.learning_rate)
