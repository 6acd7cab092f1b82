"""LocalTrainer: the Trainer protocol in this process, and the trainer-side steps it runs.

Why it exists: `lockstep run` trains in the driver's process and rank 0 of a trainer group serves the
same object to a remote driver (lockstep.trainer.server), so each step of the loop that touches the
policy is written once, here: the SFT warm start, the first update (through the pre-flight when asked),
an RL step on complete groups, an update, a checkpoint. `TrainerParts` (lockstep.trainer.parts) is what
those steps need (backend, transport, the task's text functions), built once per process.

Who calls it: lockstep.driver.policy (a local run), lockstep.trainer.server (rank 0).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

from lockstep.train.common.losses import policy_loss, sft_loss
from lockstep.train.common.lr_schedule import learning_rate_at, sft_done
from lockstep.train.common.mismatch import mismatch_weights
from lockstep.train.common.opd import apply_opd
from lockstep.train.common.packing import pack_groups, pack_sft, response_view
from lockstep.train.common.r3 import collate_routed_experts
from lockstep.trainer.metrics import batch_metrics, signal_metrics
from lockstep.trainer.parts import SftRows, TrainerParts
from lockstep.trainer.protocol import NonFiniteLoss, PreflightFailed
from lockstep.trainer.state import (
    DriverState,
    checkpoints_dir,
    latest_checkpoint,
    reference_dir,
    save_checkpoint,
    save_reference,
)
from lockstep.types import Group
from lockstep.weights.adapter import AdapterSync, check_adapter_update
from lockstep.weights.fallback import Export
from lockstep.weights.preflight import (
    PREFLIGHT_FILE,
    LogprobProbe,
    PreflightResult,
    check_weight_update_equal,
)
from lockstep.weights.transport import update_members

if TYPE_CHECKING:
    from lockstep.weights.transport import TransferReport

log = logging.getLogger(__name__)


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
        rows = SftRows(c.task, c.render, c.encode, eos, c.reply_pair)
        for k in range(s.sft_steps):
            result = c.backend.train_step(pack_sft(rows.step(k, s.sft_rows), c.pad_id), sft_loss)
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
        if self.parts.settings.check_weight_update_equal:
            return self._preflight_update(version)
        (self.parts.run_dir / PREFLIGHT_FILE).unlink(missing_ok=True)  # an earlier start's result is not ours
        return self.update_weights(version)

    def _preflight_update(self, version: int) -> dict[str, float]:
        """The first update through the pre-flight check (§7.2.5): SGLang's /weights_checker
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
        tolerance = 1e-3 if getattr(c.backend, "device_type", "cpu") == "cpu" else 0.05
        probe = LogprobProbe(probe_prompt, trainer_logprobs, tolerance=tolerance)
        reports: list[TransferReport] = []
        if isinstance(c.transport, AdapterSync):  # LoRA: the adapter is checked, the shared base never reset
            result = check_adapter_update(
                urls,
                c.transport,
                c.backend.export_weights,
                version=version,
                probe=probe,
                # the trainer's frozen base against each engine's, where both name tensors as HF does
                base=c.backend.export_base if c.settings.engine_checksums else None,
                on_report=reports.append,
            )
        else:
            result = self._check_full(urls, version, served, probe, reports)
        c.engines.reached = urls
        (c.run_dir / PREFLIGHT_FILE).write_text(result.model_dump_json(indent=2) + "\n")
        log.info("pre-flight %s: %s", "passed" if result.passed else "FAILED", result.message)
        if not result.passed:
            raise PreflightFailed(f"spec.weightSync.checkWeightUpdateEqual: {result.message}", result)
        update = reports[0].metrics() if reports else {"weight_version": float(version)}
        return {
            **update,  # the update itself, phase by phase; preflight_s adds the checks around it
            "preflight_s": c.clock() - t0,
            "preflight_tensors": float(result.checked_tensors),
            "preflight_logprob_max_abs_diff": result.logprob_max_abs_diff or 0.0,
        }

    def _check_full(
        self, urls: list[str], version: int, served: Any, probe: LogprobProbe, reports: list[TransferReport]
    ) -> PreflightResult:
        """The full-weight pre-flight (/weights_checker snapshot, reset, update, compare, checksum, probe)."""
        c = self.parts
        return check_weight_update_equal(
            urls,  # the engines of the moment (one replaced since the start has a new address)
            c.transport,
            c.backend.export_weights,
            version=version,
            probe=None if served is not None else probe,  # the trainer's forward is not quantized
            # The reference engine names tensors as HF does and hashes them on the CPU, as the trainer can;
            # SGLang fuses and shards them, so there `compare` against the loaded checkpoint decides.
            trainer_checksums=c.settings.engine_checksums,
            # The engines loaded the base checkpoint; the trainer still holds it unless it resumed or warmed up.
            compare_loaded=version == 0 and c.settings.sft_steps == 0 and served is None,
            allow_quant_error=c.settings.allow_quant_error,
            served=served,
            on_report=reports.append,
        )

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
        # OPD (§8.1): A_t - beta * d_t after the estimator, d_t against the pre-update weights.
        opd = apply_opd(batch, c.settings.opd_coef) if c.settings.opd_coef is not None else {}
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
            **opd,
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
        # An Export: a transport that falls back re-exports the same version (lockstep.weights.fallback).
        report = update_members(c.transport, c.engines, Export(c.backend.export_weights), version)
        if c.settings.offload_between_steps:
            c.backend.offload()  # §7.1: wait for the next batch off the GPU; the next call brings it back
        return report.metrics()

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
