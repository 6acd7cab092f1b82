"""LocalTrainer: the Trainer protocol in this process, and the trainer-side steps it runs.

Why it exists: `lockstep run` trains in the driver's process and rank 0 of a trainer group serves the
same object to a remote driver (lockstep.trainer.server), so each step of the loop that touches the
policy is written once, here: the SFT warm start, the first update (through the pre-flight when asked),
an RL step on complete groups, an update, a checkpoint. `TrainerParts` is what those steps need (backend,
transport, the task's text functions), built once per process by `build_trainer_parts`.

Who calls it: lockstep.driver.components (a local run), lockstep.trainer.server (rank 0).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.api import Engine, Offload, Precision
from lockstep.models import load_tokenizer
from lockstep.models.hub_data import resolve_data
from lockstep.rollout.group_signal import group_signal_metrics
from lockstep.serving.membership import EngineMembers, StaticMembers
from lockstep.tasks import Task, data_task
from lockstep.train.common.losses import policy_loss, sft_loss
from lockstep.train.common.lr_schedule import learning_rate_at, sft_done
from lockstep.train.common.mismatch import mismatch_weights
from lockstep.train.common.packing import pack_groups, pack_sft, response_view
from lockstep.train.common.r3 import collate_routed_experts
from lockstep.train.factory import build_backend as make_backend
from lockstep.trainer.protocol import PREFLIGHT_FILE, NonFiniteLoss, PreflightFailed
from lockstep.trainer.settings import TrainerSettings
from lockstep.trainer.state import (
    DriverState,
    checkpoints_dir,
    latest_checkpoint,
    reference_dir,
    save_checkpoint,
    save_reference,
)
from lockstep.types import Group, SampleStatus
from lockstep.weights.factory import build_transport
from lockstep.weights.preflight import LogprobProbe, PreflightResult, check_weight_update_equal
from lockstep.weights.transport import EngineSet, update_members

if TYPE_CHECKING:
    from lockstep.api import RLJob
    from lockstep.train.backend import TrainBackend
    from lockstep.train.common.batch import TrainBatch
    from lockstep.weights.transport import WeightTransport

log = logging.getLogger(__name__)

SFT_ITEM_BASE = 10_000_000
"""SFT warm-start items are drawn from this train-split offset, apart from the RL prompts."""


@dataclass(slots=True)
class TrainerParts:
    """Everything the trainer-side steps need; built once per process."""

    job: RLJob
    """The validated manifest (spec.weightSync for the pre-flight)."""
    settings: TrainerSettings
    """Learning rates, SFT warm start, loss, seed."""
    run_dir: Path
    """Where checkpoints/ and preflight.json are written (the trainer's run dir)."""
    backend: TrainBackend
    """The sharded policy (on rank 0 of a group: lockstep.trainer.spmd.LeaderBackend)."""
    transport: WeightTransport
    """How versions reach the engines."""
    engines: EngineSet
    """The engines each update reaches (asked again before every update)."""
    pad_id: int
    """Padding token ID for packing."""
    eos_id: int
    """The token that ends an assistant turn (closes each SFT answer)."""
    engine_urls: list[str]
    """The engines known at start (each update and the pre-flight ask `engines` for those of the moment)."""
    render: Callable[[Sequence[Mapping[str, Any]]], list[int]]
    """Chat messages -> prompt token IDs (with the generation prompt), as the rollout renders them."""
    encode: Callable[[str], list[int]]
    """Text -> token IDs (SFT answers)."""
    task: Task
    """Prompts and reference answers (SFT warm start, pre-flight probe prompt)."""
    clock: Callable[[], float] = time.monotonic
    """Injected monotonic clock (step timings)."""


class LocalTrainer:
    """The Trainer in this process: `lockstep run`, a driver without a trainer URL, rank 0 of a group."""

    def __init__(self, parts: TrainerParts) -> None:
        self.parts = parts
        """The backend, transport and task functions the steps run on."""
        self.rl_steps = 0
        """RL optimizer steps done (restored by load_latest): the learning-rate schedule's position."""

    def warm_start(self) -> Iterator[dict[str, float]]:
        """The SFT warm start: `sft_steps` steps of NLL on the task's reference answers (assistant tokens
        only), with the RL optimizer, ending early at `sft_stop_at_loss`; items come from a train-split
        offset (SFT_ITEM_BASE) so RL prompts are not the ones just imitated. With a KL term, the
        warm-started policy then becomes its reference (saved as RUN_DIR/reference for resume)."""
        c, s = self.parts, self.parts.settings
        eos = [c.eos_id]
        if s.sft_learning_rate is not None:
            c.backend.set_learning_rate(s.sft_learning_rate)
        losses: list[float] = []
        for k in range(s.sft_steps):
            pairs = []
            for j in range(s.sft_rows):
                item = c.task.item(SFT_ITEM_BASE + k * s.sft_rows + j, "train")
                pairs.append((c.render(item.messages), c.encode(item.answer) + eos))
            result = c.backend.train_step(pack_sft(pairs, c.pad_id), sft_loss)
            if result.skipped:
                raise NonFiniteLoss(f"SFT warm start step {k}: non-finite loss {result.loss}")
            yield {"loss": result.loss, "grad_norm": result.grad_norm, **result.metrics}
            losses.append(result.loss)
            if sft_done(losses, s.sft_stop_at_loss):
                log.info(
                    "SFT warm start: mean loss of the last steps reached %s at step %d",
                    s.sft_stop_at_loss,
                    k + 1,
                )
                break
        c.backend.set_learning_rate(s.learning_rate)
        if s.loss.kl_coef > 0:  # the KL term compares with the policy RL starts from: the warm-started one
            c.backend.set_reference(save_reference(c.backend, c.run_dir))

    def first_update(self, version: int) -> dict[str, float]:
        """The update before step 1: through the pre-flight check when spec.weightSync.checkWeightUpdateEqual."""
        if self.parts.job.spec.weight_sync.check_weight_update_equal:
            return self._preflight_update(version)
        (self.parts.run_dir / PREFLIGHT_FILE).unlink(missing_ok=True)  # an earlier start's result is not ours
        return self.update_weights(version)

    def _preflight_update(self, version: int) -> dict[str, float]:
        """The first update through the pre-flight check (seed §7.2.5): SGLang's /weights_checker
        snapshot and reset_tensors on every engine, the update, then compare and checksum.

        Raises PreflightFailed naming the differing tensors (or the logprob probe gap) before any step.
        """
        c = self.parts

        def trainer_logprobs(prompt: list[int], response: list[int]) -> list[float]:
            batch = pack_sft([(prompt, response)], c.pad_id)  # greedy probe: temperature 1 definition
            return response_view(batch, c.backend.compute_logprobs(batch), 0)

        probe_prompt = c.render(c.task.item(0, "train").messages)
        served = getattr(c.transport, "served", None)  # a QuantizingTransport: engines hold fake-quantized
        t0 = c.clock()
        urls = c.engines.targets(version)
        c.transport.follow(urls)
        result = check_weight_update_equal(
            urls,  # the engines of the moment (one replaced since the start has a new address)
            c.transport,
            c.backend.export_weights,
            version=version,
            probe=None
            if served is not None  # the trainer's forward is not quantized: precision-check compares
            else LogprobProbe(
                probe_prompt,
                trainer_logprobs,
                tolerance=1e-3 if getattr(c.backend, "device_type", "cpu") == "cpu" else 0.05,
            ),
            # The reference engine names tensors as HF does and hashes them on the CPU, as the trainer can;
            # SGLang fuses and shards them, so there `compare` against the loaded checkpoint decides.
            trainer_checksums=c.job.spec.rollout.engine is Engine.REFERENCE,
            # The engines loaded the base checkpoint; the trainer still holds it unless it resumed or warmed up.
            compare_loaded=version == 0 and c.settings.sft_steps == 0 and served is None,
            allow_quant_error=c.job.spec.rollout.precision is not Precision.BF16,
            served=served,
        )
        c.engines.reached = urls
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

    def train(self, groups: list[Group]) -> dict[str, float]:
        """One RL optimizer step on complete groups; returns the step's metrics.

        Recomputes the trainer's logprobs of the exact rollout token IDs with the pre-update weights
        (train_old), measures the train-rollout mismatch, then trains with the configured loss.
        Raises NonFiniteLoss when the step could not be applied (weights unchanged).
        """
        c, loss = self.parts, self.parts.settings.loss
        lr = learning_rate_at(c.settings.lr_schedule, self.rl_steps + 1)
        c.backend.set_learning_rate(lr)
        batch = pack_groups(groups, loss.estimator, c.pad_id, c.settings.temperature)
        batch.routed_experts = collate_routed_experts(groups)  # R3: one payload per row (None without)
        t0 = c.clock()
        batch.old_logprobs = c.backend.compute_logprobs(batch)
        if loss.kl_coef > 0:
            batch.ref_logprobs = c.backend.compute_logprobs(batch, role="ref")
        _, mismatch = mismatch_weights(
            batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, loss.mismatch
        )
        t1 = c.clock()
        # A partial of a module-level function (not a closure) so rank 0 can send it to the other ranks.
        result = c.backend.train_step(batch, partial(policy_loss, config=loss))
        if result.skipped:
            raise NonFiniteLoss(
                f"non-finite loss ({result.loss}) or gradient norm ({result.grad_norm}); the step was not applied"
            )
        self.rl_steps += 1
        return {
            **batch_metrics(groups),
            **signal_metrics(batch),
            **mismatch,
            **result.metrics,
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "learning_rate": lr,
            "train_tokens": float(result.tokens),
            "time_logprobs_s": t1 - t0,
            "time_train_s": c.clock() - t1,
        }

    def update_weights(self, version: int) -> dict[str, float]:
        """Push the trainer's current weights to every engine as `version`."""
        c = self.parts
        report = update_members(c.transport, c.engines, c.backend.export_weights(), version)
        if c.job.spec.trainer.offload is not Offload.NONE:
            c.backend.offload()  # seed §7.1: wait for the next batch off the GPU; the next call brings it back
        return {"weight_version": float(report.version), "update_weights_s": report.seconds, **report.extra}

    def save(self, state: DriverState) -> str:
        return str(save_checkpoint(self.parts.backend, self.parts.run_dir, state))

    def load_latest(self) -> DriverState | None:
        path = latest_checkpoint(self.parts.run_dir)
        if path is None:
            return None
        c = self.parts
        state = DriverState.from_dict(c.backend.load(path))
        self.rl_steps = state.step
        if c.settings.loss.kl_coef > 0 and c.settings.sft_steps > 0 and state.sft_done:
            reference = reference_dir(c.run_dir)
            if not reference.is_dir():
                raise FileNotFoundError(
                    f"resume: {reference} (the warm-started policy, spec.algorithm.kl's reference) is "
                    "missing; resume in the run dir that holds it, or start a new run dir"
                )
            c.backend.set_reference(reference)
        return state

    def preflight_result(self) -> PreflightResult | None:
        """The pre-flight result the last first_update wrote (None when the check did not run)."""
        path = self.parts.run_dir / PREFLIGHT_FILE
        return PreflightResult.model_validate_json(path.read_text()) if path.is_file() else None

    def where(self) -> str:
        """Where checkpoints live (named in errors)."""
        return str(checkpoints_dir(self.parts.run_dir))

    def shutdown(self) -> None:
        """Nothing to end: this process is the trainer."""

    def close(self) -> None:
        """Nothing of its own: the backend and transport are closed by whoever built them."""


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
        **group_signal_metrics([g.rewards for g in groups]),
    }


def signal_metrics(batch: TrainBatch) -> dict[str, float]:
    """What the step could learn from: the mean |advantage| and the sampled tokens' entropy estimate.

    The entropy estimate is the mean negative logprob (pre-update, at the rollout temperature) of the
    trained tokens: an unbiased estimate of the policy's per-token entropy on its own samples.
    """
    mask = batch.loss_mask
    n = max(float(mask.sum().item()), 1.0)
    out = {"advantage_abs_mean": float((batch.advantages.abs() * mask).sum().item()) / n}
    if batch.old_logprobs is not None:
        out["entropy_estimate"] = float((-batch.old_logprobs * mask).sum().item()) / n
    return out


def build_backend(
    job: RLJob, settings: TrainerSettings, model_dir: Path, *, embedded_engines: bool = False
) -> TrainBackend:
    """The backend spec.trainer.backend names (one rank here; torchrun env makes it one of many).
    embedded_engines: the rollout engines are reference engines in this process (`lockstep run`
    without engine URLs), whatever spec.rollout.engine says."""
    return make_backend(
        job,
        model_dir,
        lr=settings.learning_rate,
        grad_clip=settings.grad_clip,
        micro_batch_size=settings.micro_batch_size,
        seed=settings.seed,
        embedded_engines=embedded_engines,
    )


def build_trainer_parts(
    job: RLJob,
    settings: TrainerSettings,
    run_dir: Path,
    model_dir: Path,
    backend: TrainBackend,
    engine_urls: Sequence[str],
    closers: list[Callable[[], None]],
    master_address: str = "127.0.0.1",
    members: EngineMembers | None = None,
) -> TrainerParts:
    """The trainer side of a run: the transport to the engines `engine_urls` (ready now), the task's
    text functions.

    `closers` receives the transport's close (the caller already owns the backend's);
    `master_address` is where engines reach this process (broadcast's weight-update group);
    `members` is where each update finds the engines of the moment (default: exactly `engine_urls`; a
    trainer group in a cluster: the pool's headless Service, lockstep.serving.membership).
    """
    tokenizer = load_tokenizer(model_dir, job.spec.model.tokenizer, job.spec.model.chat_template)
    task = data_task(resolve_data(job.spec.data))
    device = str(getattr(backend, "device_type", "cpu"))
    urls = sorted(u.rstrip("/") for u in engine_urls)
    transport = build_transport(job, run_dir, model_dir, urls, device, master_address)
    closers.append(transport.close)
    return TrainerParts(
        job=job,
        settings=settings,
        run_dir=Path(run_dir),
        backend=backend,
        transport=transport,
        engines=EngineSet(members or StaticMembers(tuple(urls)), urls),
        pad_id=tokenizer.pad_token_id,
        eos_id=tokenizer.eos_token_id,
        engine_urls=[u.rstrip("/") for u in engine_urls],
        render=lambda msgs: tokenizer.render(msgs, add_generation_prompt=True),
        encode=tokenizer.encode,
        task=task,
    )
